package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/picker"
)

func startFleet(t *testing.T, n int) *Fleet {
	t.Helper()
	f, err := StartFleet(context.Background(), n, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	t.Cleanup(f.Close)
	return f
}

func podOf(t *testing.T, f *Fleet, addr string) *SimPod {
	t.Helper()
	for _, p := range f.Pods {
		if p.Addr() == addr {
			return p
		}
	}
	t.Fatalf("no pod %s", addr)
	return nil
}

func TestRouterPullsThePrefixWhenTheHolderIsBusy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f := startFleet(t, 3)
	rng := rand.New(rand.NewPCG(1, 2))
	system := randomTokens(rng, 4096) // 256 blocks

	first := join(system, randomTokens(rng, 100))
	r, err := f.Complete(ctx, first)
	require.NoError(t, err)
	require.Equal(t, string(picker.ReasonNoHolder), r.Reason)
	holder := podOf(t, f, r.Destination)
	require.NoError(t, f.WaitIndexed(ctx, holder, first))

	// Keep the holder busy so that least-loaded placement goes elsewhere.
	gate := make(chan struct{})
	holder.Hold(gate)
	parked := make(chan error, 1)
	go func() {
		_, err := f.Complete(ctx, randomTokens(rng, 64))
		parked <- err
	}()
	require.Eventually(t, func() bool {
		for _, b := range f.Router.backends {
			if b.Addr == holder.Addr() {
				return b.inflight.Load() == 1
			}
		}
		return false
	}, 5*time.Second, time.Millisecond)

	r, err = f.Complete(ctx, join(system, randomTokens(rng, 100)))
	require.NoError(t, err)
	close(gate)
	require.NoError(t, <-parked)
	require.NotEqual(t, holder.Addr(), r.Destination)
	require.Equal(t, string(picker.ReasonPull), r.Reason)
	require.Equal(t, holder.Addr(), r.Source)
	require.Equal(t, 256, r.Pull.Blocks)
	require.True(t, r.Pull.Verified)
	require.Equal(t, 256*16, r.CachedTokens)

	dest := podOf(t, f, r.Destination)
	served := dest.Served()
	require.Len(t, served, 1)
	s := served[0]
	require.Equal(t, holder.Addr(), s.SourceHeader, "llm-d's header names the source pod")
	require.NotNil(t, s.RemoteSource, "vLLM's kv_transfer_params name the source")
	require.Equal(t, "127.0.0.1", s.RemoteSource.RemoteHost)
	require.Equal(t, holder.P2PPort(), s.RemoteSource.RemotePort)
	require.NotEmpty(t, s.RemoteSource.KVRequestID)
	require.Equal(t, 0, s.CachedBlocks)
	require.Equal(t, 256, s.PulledBlocks)
	require.Equal(t, 6, s.ComputeBlocks)
	require.True(t, s.PullVerified)
	require.Empty(t, s.PullError)

	// With the fleet idle again, a prefix holder wins the tie and nothing
	// is pulled.
	require.NoError(t, f.WaitIndexed(ctx, dest, join(system, nil)))
	r, err = f.Complete(ctx, join(system, randomTokens(rng, 100)))
	require.NoError(t, err)
	require.Contains(t, []string{holder.Addr(), dest.Addr()}, r.Destination)
	require.Empty(t, r.Source)
	require.Equal(t, 0, r.Pull.Blocks)
	last := podOf(t, f, r.Destination).Served()
	require.Empty(t, last[len(last)-1].SourceHeader)
	require.Nil(t, last[len(last)-1].RemoteSource)
	require.Equal(t, 256, last[len(last)-1].CachedBlocks)
}

func TestRouterRejectsPromptsItCannotHash(t *testing.T) {
	f := startFleet(t, 2)
	for _, tc := range []struct {
		name, body, want string
	}{
		{"text prompt", `{"model":"m","prompt":"hello"}`, "array of token ids"},
		{"negative token", `{"model":"m","prompt":[1,-2]}`, "not a uint32"},
		{"no prompt", `{"model":"m"}`, "prompt is required"},
		{"not json", `{`, "not a JSON completions request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(f.URL+"/v1/completions", "application/json", bytes.NewBufferString(tc.body))
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, http.StatusBadRequest, resp.StatusCode)
			var e struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
			require.Contains(t, e.Error.Message, tc.want)
		})
	}
	for _, p := range f.Pods {
		require.Empty(t, p.Served(), "nothing reached a pod")
	}
}

func TestRouterDropsASourceTheClientNamed(t *testing.T) {
	f := startFleet(t, 2)
	peer := f.Pods[1]
	for _, tc := range []struct {
		name, params string
	}{
		{"header only", `{}`},
		{"header and remote_kv_source", fmt.Sprintf(`{"do_remote_decode":true,"remote_kv_source":{"kv_request_id":"x","remote_host":"127.0.0.1","remote_port":%d}}`, peer.P2PPort())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := fmt.Sprintf(`{"model":%q,"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"kv_transfer_params":%s}`, model, tc.params)
			req, err := http.NewRequest(http.MethodPost, f.URL+"/v1/completions", bytes.NewBufferString(body))
			require.NoError(t, err)
			req.Header.Set(picker.HeaderKVCacheSource, peer.Addr())
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.NotEqual(t, string(picker.ReasonPull), resp.Header.Get(HeaderReason))
			served := podOf(t, f, resp.Header.Get(HeaderDestination)).Served()
			s := served[len(served)-1]
			require.Empty(t, s.SourceHeader, "the client's source header reached the pod")
			require.Nil(t, s.RemoteSource, "the client's remote_kv_source reached the pod")
		})
	}
}

func TestTransferParamsKeepTheRestOfTheBody(t *testing.T) {
	body := []byte(`{"model":"m","prompt":[1],"max_tokens":7,"kv_transfer_params":{"do_remote_decode":true}}`)
	out, err := withTransferParams(body, picker.KVTransferParams{RemoteKVSource: &picker.RemoteKVSource{KVRequestID: "r1", RemoteHost: "10.0.0.2", RemotePort: 5710}})
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(out, &m))
	require.Equal(t, 7.0, m["max_tokens"])
	require.Equal(t, map[string]any{
		"do_remote_decode": true,
		"remote_kv_source": map[string]any{"kv_request_id": "r1", "remote_host": "10.0.0.2", "remote_port": 5710.0},
	}, m["kv_transfer_params"])

	out, err = withTransferParams(body, picker.KVTransferParams{})
	require.NoError(t, err)
	require.JSONEq(t, `{"model":"m","prompt":[1],"max_tokens":7,"kv_transfer_params":{"do_remote_decode":true}}`, string(out), "no source: none set")

	_, err = withTransferParams([]byte(`{"kv_transfer_params":[1]}`), picker.KVTransferParams{RemoteKVSource: &picker.RemoteKVSource{}})
	require.ErrorContains(t, err, "not an object")
}

func TestWalkthroughPrintsAPullAndALocalHit(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run(context.Background(), nil, &out, &errOut))
	require.Contains(t, out.String(), "no_holder")
	require.Contains(t, out.String(), "pull")
	require.Contains(t, out.String(), "true")
}
