package service_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/kvsource/kvsource/service"
)

// A Go gateway mounts kvsource's API in its own mux, beside its own routes,
// instead of running kvsource serve as a second process.
func Example_mount() {
	ctx := context.Background()
	svc, err := service.New(ctx, service.Config{
		// EventsBind: []string{"tcp://*:5557"}, where the engines publish.
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := svc.Start(ctx); err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = svc.Shutdown(ctx) }()

	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "hello from the gateway") })
	mux.Handle("/kv/", http.StripPrefix("/kv", svc.Handler()))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for _, req := range []struct{ method, path, body string }{
		{"GET", "/hello", ""},
		{"GET", "/kv/healthz", ""},
		{"POST", "/kv/v1/score", `{"model": "m", "tokens": [1, 2, 3]}`},
	} {
		r, _ := http.NewRequest(req.method, srv.URL+req.path, strings.NewReader(req.body))
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			fmt.Println(err)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(req.path, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	// Output:
	// /hello 200 hello from the gateway
	// /kv/healthz 200 {"status":"ok"}
	// /kv/v1/score 200 {"model":"m","blocks":0,"pods":[]}
}
