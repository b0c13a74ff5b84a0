package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvsource/kvsource/service"
)

// kvsource serve runs package service for routers not written in Go; its
// flags are service.ParseFlags', and its API is in the package's doc.

func init() {
	commands["serve"] = command{summary: "run events, index and picker as an HTTP JSON service", run: runServe}
}

func runServe(args []string, _ io.Reader, stdout, stderr io.Writer) int {
	var usage bytes.Buffer
	fs := flag.NewFlagSet("kvsource serve", flag.ContinueOnError)
	fs.SetOutput(&usage)
	fs.Usage = func() {
		fmt.Fprintln(&usage, "usage: kvsource serve [--events-bind tcp://HOST:PORT]...")
		fmt.Fprintln(&usage, "                      [--events-connect POD=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=MODEL]]...")
		fmt.Fprintln(&usage, "                      [--events-replay POD=tcp://HOST:PORT]...")
		fmt.Fprintln(&usage, "                      [--http 127.0.0.1:8080] [--keys engine|content] [--algo A] [--seed S] [--block-size N]")
		fmt.Fprintln(&usage, "                      [--min-cached-token-delta N] [--snapshot FILE] [--calibration FILE]")
		fmt.Fprintln(&usage, "                      [--nats nats://HOST:4222 --role relay|replica]")
		fmt.Fprintln(&usage, "endpoints: POST /v1/score, POST /v1/pick, POST /v1/done, GET /v1/pods, GET /metrics, GET /healthz")
		fs.PrintDefaults()
	}
	cfg, err := service.ParseFlags(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		_, _ = usage.WriteTo(stdout)
		return 0
	}
	if err != nil {
		_, _ = usage.WriteTo(stderr)
		fmt.Fprintf(stderr, "kvsource serve: %v\n", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	cfg.Logger = log
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	service.ApplyMemoryLimit(cfg.IndexMemory, log)
	s, err := service.New(ctx, cfg)
	if err != nil {
		log.Error("kvsource serve: start-up failed", "err", err)
		return 1
	}
	ln, err := net.Listen("tcp", cfg.HTTP)
	if err == nil {
		err = s.Start(ctx)
	}
	if err != nil {
		log.Error("kvsource serve: start-up failed", "err", err)
		_ = s.Shutdown(context.Background())
		return 1
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	fmt.Fprintf(stdout, "kvsource serve: listening on http://%s\n", ln.Addr())
	code := 0
	select {
	case <-ctx.Done():
	case err := <-served:
		log.Error("kvsource serve: http", "err", err)
		code = 1
	}
	stop()
	log.Info("kvsource serve: shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	if err := s.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Error("kvsource serve: shutdown", "err", err)
		return 1
	}
	return code
}
