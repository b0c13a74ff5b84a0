//go:build cgo && nixl

// The NIXL data plane, built with -tags nixl. It talks to libnixl_capi, the
// C API NIXL v1.4.0 builds from src/bindings/rust/wrapper.cpp. v1.4.0
// installs no header for it, so the declarations used are below, copied
// from that release's src/bindings/rust/wrapper.h. Where the header is on
// the include path as <nixl_capi/wrapper.h> (the build in ../shared/nixl
// ships it; scripts/nixl.sh sets CGO_CFLAGS), the preamble includes it and
// the C compiler checks every declaration below against it. Releases
// before v1.4.0 took a third "sorted" argument in
// nixl_capi_create_xfer_dlist and nixl_capi_create_reg_dlist and are not
// supported. v1.4.0's nixl_capi_get_local_md returns malloc'd memory,
// released here with free(); NIXL's PR #2180 turns that into
// nixl_capi_mem_free.
//
// Build and test where NIXL (with UCX) is installed under $NIXL_PREFIX
// (make test does this with ../shared/nixl; see scripts/nixl.sh):
//
//	LIB=$NIXL_PREFIX/lib/x86_64-linux-gnu
//	export CGO_CFLAGS="-O2 -g -I$NIXL_PREFIX/include"
//	export CGO_LDFLAGS="-L$LIB"
//	export LD_LIBRARY_PATH="$LIB"
//	go test -tags nixl -race ./transfer/...
//
// LD_LIBRARY_PATH is needed at run time: Go's link writes a RUNPATH for
// -Wl,-rpath, and a RUNPATH is not used for libnixl_capi.so's own
// dependencies (libnixl.so, UCX, Abseil); -Wl,--disable-new-dtags with the
// rpath works too. NIXL_PLUGIN_DIR is not needed: NIXL looks for its
// plugins in the plugins directory beside libnixl.so. The tests run two
// agents in one process over UCX loopback (cma for the RMA, tcp for
// messages).

package p2p

/*
#cgo LDFLAGS: -lnixl_capi
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if __has_include(<nixl_capi/wrapper.h>)
#include <nixl_capi/wrapper.h>
#else
typedef enum {
	NIXL_CAPI_SUCCESS = 0,
	NIXL_CAPI_ERROR_INVALID_PARAM = -1,
	NIXL_CAPI_ERROR_BACKEND = -2,
	NIXL_CAPI_ERROR_INVALID_STATE = -3,
	NIXL_CAPI_ERROR_EXCEPTION = -4,
	NIXL_CAPI_IN_PROG = 1,
	NIXL_CAPI_ERROR_NO_TELEMETRY = -5,
} nixl_capi_status_t;

typedef enum {
	NIXL_CAPI_MEM_DRAM = 0,
	NIXL_CAPI_MEM_VRAM = 1,
	NIXL_CAPI_MEM_BLOCK = 2,
	NIXL_CAPI_MEM_OBJECT = 3,
	NIXL_CAPI_MEM_FILE = 4,
	NIXL_CAPI_MEM_UNKNOWN = 5
} nixl_capi_mem_type_t;

typedef enum {
	NIXL_CAPI_THREAD_SYNC_NONE = 0,
	NIXL_CAPI_THREAD_SYNC_STRICT = 1,
	NIXL_CAPI_THREAD_SYNC_RW = 2,
	NIXL_CAPI_THREAD_SYNC_DEFAULT = NIXL_CAPI_THREAD_SYNC_NONE,
} nixl_capi_thread_sync_t;

typedef struct nixl_capi_agent_config_s {
	bool enable_prog_thread;
	bool enable_listen_thread;
	int listen_port;
	nixl_capi_thread_sync_t thread_sync;
	unsigned int num_workers;
	uint64_t pthr_delay_us;
	uint64_t lthr_delay_us;
	bool capture_telemetry;
} nixl_capi_agent_config_t;

typedef enum {
	NIXL_CAPI_XFER_OP_READ = 0,
	NIXL_CAPI_XFER_OP_WRITE = 1,
} nixl_capi_xfer_op_t;

typedef struct nixl_capi_agent_s *nixl_capi_agent_t;
typedef struct nixl_capi_params_s *nixl_capi_params_t;
typedef struct nixl_capi_mem_list_s *nixl_capi_mem_list_t;
typedef struct nixl_capi_backend_s *nixl_capi_backend_t;
typedef struct nixl_capi_opt_args_s *nixl_capi_opt_args_t;
typedef struct nixl_capi_xfer_dlist_s *nixl_capi_xfer_dlist_t;
typedef struct nixl_capi_xfer_dlist_handle_s *nixl_capi_xfer_dlist_handle_t;
typedef struct nixl_capi_reg_dlist_s *nixl_capi_reg_dlist_t;
typedef struct nixl_capi_xfer_req_s *nixl_capi_xfer_req_t;
#endif

nixl_capi_status_t nixl_capi_create_configured_agent(const char *name, const nixl_capi_agent_config_t *cfg,
	nixl_capi_agent_t *agent);
nixl_capi_status_t nixl_capi_destroy_agent(nixl_capi_agent_t agent);

nixl_capi_status_t nixl_capi_get_plugin_params(nixl_capi_agent_t agent, const char *plugin,
	nixl_capi_mem_list_t *mems, nixl_capi_params_t *params);
nixl_capi_status_t nixl_capi_params_add(nixl_capi_params_t params, const char *key, const char *value);
nixl_capi_status_t nixl_capi_destroy_params(nixl_capi_params_t params);
nixl_capi_status_t nixl_capi_destroy_mem_list(nixl_capi_mem_list_t list);
nixl_capi_status_t nixl_capi_create_backend(nixl_capi_agent_t agent, const char *plugin,
	nixl_capi_params_t params, nixl_capi_backend_t *backend);
nixl_capi_status_t nixl_capi_destroy_backend(nixl_capi_backend_t backend);

nixl_capi_status_t nixl_capi_create_reg_dlist(nixl_capi_mem_type_t mem_type, nixl_capi_reg_dlist_t *dlist);
nixl_capi_status_t nixl_capi_reg_dlist_add_desc(nixl_capi_reg_dlist_t dlist, uintptr_t addr, size_t len,
	uint64_t dev_id, const void *metadata, size_t metadata_len);
nixl_capi_status_t nixl_capi_register_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist,
	nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_deregister_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist,
	nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_destroy_reg_dlist(nixl_capi_reg_dlist_t dlist);

nixl_capi_status_t nixl_capi_get_local_md(nixl_capi_agent_t agent, void **data, size_t *len);
nixl_capi_status_t nixl_capi_load_remote_md(nixl_capi_agent_t agent, const void *data, size_t len,
	char **agent_name);
nixl_capi_status_t nixl_capi_invalidate_remote_md(nixl_capi_agent_t agent, const char *remote_agent);

nixl_capi_status_t nixl_capi_create_xfer_dlist(nixl_capi_mem_type_t mem_type, nixl_capi_xfer_dlist_t *dlist);
nixl_capi_status_t nixl_capi_xfer_dlist_add_desc(nixl_capi_xfer_dlist_t dlist, uintptr_t addr, size_t len,
	uint64_t dev_id);
nixl_capi_status_t nixl_capi_destroy_xfer_dlist(nixl_capi_xfer_dlist_t dlist);
nixl_capi_status_t nixl_capi_prep_xfer_dlist(nixl_capi_agent_t agent, const char *agent_name,
	nixl_capi_xfer_dlist_t descs, nixl_capi_xfer_dlist_handle_t *dlist_hndl, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_release_xfer_dlist_handle(nixl_capi_agent_t agent,
	nixl_capi_xfer_dlist_handle_t dlist_handle);

nixl_capi_status_t nixl_capi_make_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_op_t operation,
	nixl_capi_xfer_dlist_handle_t local_descs, const int *local_indices, size_t local_indices_count,
	nixl_capi_xfer_dlist_handle_t remote_descs, const int *remote_indices, size_t remote_indices_count,
	nixl_capi_xfer_req_t *req_hndl, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_post_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl,
	nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_get_xfer_status(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl);
nixl_capi_status_t nixl_capi_release_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req);
nixl_capi_status_t nixl_capi_destroy_xfer_req(nixl_capi_xfer_req_t req);
*/
import "C"

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"
	"unsafe"
)

// running reports whether a transfer status means the request may still
// write. nixl_capi_get_xfer_status answers only NIXL_CAPI_SUCCESS,
// NIXL_CAPI_IN_PROG or NIXL_CAPI_ERROR_BACKEND (v1.4.0 has no status for
// "running, some entry failed"); releasing a failed request cancels what
// of it may still run.
func running(st C.nixl_capi_status_t) bool { return st == C.NIXL_CAPI_IN_PROG }

// localAgent is the agent name prep_xfer_dlist takes for the local agent's
// own descriptors (NIXL_INIT_AGENT).
const localAgent = ""

// NIXLConfig configures a NIXL data plane. The zero value is vLLM's setup
// but for ProgressDelay (vLLM's agents spin).
type NIXLConfig struct {
	// Name of the agent; it must differ from every peer's. Default a random
	// "kvsource-<hex>" (vLLM uses a uuid4).
	Name string
	// Backend is the NIXL plugin. Default "UCX".
	Backend string
	// NumThreads is the backend's "num_threads" init parameter. Default 4.
	NumThreads int
	// PollInterval is the longest pause between polls of a transfer's
	// status. Default 100 µs.
	PollInterval time.Duration
	// ProgressDelay is the longest the backend's progress thread sleeps
	// between rounds when no event wakes it (the agent's pthrDelay; UCX
	// rounds it up to whole milliseconds). NIXL's default, 0, never
	// sleeps: each idle agent spins on a core. The thread wakes at once on
	// its workers' events, so the delay only bounds the periodic
	// progress. Default 10 ms.
	ProgressDelay time.Duration
}

type nixlError struct {
	op     string
	status C.nixl_capi_status_t
}

func (e nixlError) Error() string { return fmt.Sprintf("nixl: %s: status %d", e.op, int(e.status)) }

func (e nixlError) Unwrap() error { return ErrDataPlane }

func check(op string, st C.nixl_capi_status_t) error {
	if st != C.NIXL_CAPI_SUCCESS {
		return nixlError{op, st}
	}
	return nil
}

// NIXL is a DataPlane over NIXL's C API: one agent with one backend, one
// registered DRAM region, and per-block transfer descriptors on both sides
// so that a WRITE names blocks by index, as vLLM's NIXL data plane does.
// Memory passed to Register must not be Go-heap memory (use AllocRegion):
// NIXL keeps its address.
type NIXL struct {
	cfg NIXLConfig
	// mu serialises every call into the agent: it is created without
	// thread synchronisation.
	mu      sync.Mutex
	agent   C.nixl_capi_agent_t
	backend C.nixl_capi_backend_t
	reg     C.nixl_capi_reg_dlist_t
	local   C.nixl_capi_xfer_dlist_handle_t
	blocks  int
	// peers counts the open Remotes of each peer agent: NIXL keeps one
	// metadata entry per agent name, so a peer is unloaded only when its
	// last Remote closes (a consumer that reconnects while its old session
	// is reaped has two).
	peers map[string]int
}

var _ DataPlane = (*NIXL)(nil)

// NewNIXL creates the agent and its backend.
func NewNIXL(cfg NIXLConfig) (*NIXL, error) {
	if cfg.Name == "" {
		var b [16]byte
		_, _ = rand.Read(b[:])
		cfg.Name = "kvsource-" + hex.EncodeToString(b[:])
	}
	if cfg.Backend == "" {
		cfg.Backend = "UCX"
	}
	if cfg.NumThreads <= 0 {
		cfg.NumThreads = 4
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = 100 * time.Microsecond
	}
	if cfg.ProgressDelay <= 0 {
		cfg.ProgressDelay = 10 * time.Millisecond
	}
	n := &NIXL{cfg: cfg, peers: make(map[string]int)}
	name := C.CString(cfg.Name)
	defer C.free(unsafe.Pointer(name))
	// nixl_capi_create_agent's config, but for the progress thread's delay.
	// No thread sync: n.mu serialises every call.
	acfg := C.nixl_capi_agent_config_t{
		enable_prog_thread: true,
		thread_sync:        C.NIXL_CAPI_THREAD_SYNC_NONE,
		num_workers:        1,
		pthr_delay_us:      C.uint64_t(cfg.ProgressDelay.Microseconds()),
		lthr_delay_us:      100_000, // nixlAgentConfig's default; no listener runs
	}
	if err := check("create_configured_agent", C.nixl_capi_create_configured_agent(name, &acfg, &n.agent)); err != nil {
		return nil, err
	}
	if err := n.createBackend(); err != nil {
		_ = C.nixl_capi_destroy_agent(n.agent)
		return nil, err
	}
	return n, nil
}

func (n *NIXL) createBackend() error {
	plugin := C.CString(n.cfg.Backend)
	defer C.free(unsafe.Pointer(plugin))
	var mems C.nixl_capi_mem_list_t
	var params C.nixl_capi_params_t
	if err := check("get_plugin_params", C.nixl_capi_get_plugin_params(n.agent, plugin, &mems, &params)); err != nil {
		return err
	}
	defer C.nixl_capi_destroy_mem_list(mems)
	defer C.nixl_capi_destroy_params(params)
	key := C.CString("num_threads")
	defer C.free(unsafe.Pointer(key))
	val := C.CString(fmt.Sprint(n.cfg.NumThreads))
	defer C.free(unsafe.Pointer(val))
	if err := check("params_add", C.nixl_capi_params_add(params, key, val)); err != nil {
		return err
	}
	return check("create_backend", C.nixl_capi_create_backend(n.agent, plugin, params, &n.backend))
}

// Name returns the agent's name.
func (n *NIXL) Name() string { return n.cfg.Name }

// blockDescs returns a prepared descriptor list of count blocks of blockLen
// bytes from base, owned by agent ("" for the local agent): descriptor i is
// block i.
func (n *NIXL) blockDescs(agent string, base uintptr, count, blockLen int) (C.nixl_capi_xfer_dlist_handle_t, error) {
	var h C.nixl_capi_xfer_dlist_handle_t
	var x C.nixl_capi_xfer_dlist_t
	if err := check("create_xfer_dlist", C.nixl_capi_create_xfer_dlist(C.NIXL_CAPI_MEM_DRAM, &x)); err != nil {
		return h, err
	}
	defer C.nixl_capi_destroy_xfer_dlist(x)
	for i := range count {
		addr := C.uintptr_t(base + uintptr(i*blockLen))
		if err := check("xfer_dlist_add_desc", C.nixl_capi_xfer_dlist_add_desc(x, addr, C.size_t(blockLen), 0)); err != nil {
			return h, err
		}
	}
	name := C.CString(agent)
	defer C.free(unsafe.Pointer(name))
	if err := check("prep_xfer_dlist", C.nixl_capi_prep_xfer_dlist(n.agent, name, x, &h, nil)); err != nil {
		return h, err
	}
	return h, nil
}

// Register implements DataPlane: one DRAM region on device 0, per-block
// local descriptors, then the agent metadata (taken after registration, so
// it describes the region).
func (n *NIXL) Register(mem []byte, blockLen int) ([]byte, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.reg != nil {
		return nil, fmt.Errorf("%w: already registered", ErrDataPlane)
	}
	if blockLen <= 0 || len(mem) < blockLen {
		return nil, fmt.Errorf("%w: region of %d bytes cannot hold blocks of %d", ErrDataPlane, len(mem), blockLen)
	}
	blocks := len(mem) / blockLen
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	var reg C.nixl_capi_reg_dlist_t
	if err := check("create_reg_dlist", C.nixl_capi_create_reg_dlist(C.NIXL_CAPI_MEM_DRAM, &reg)); err != nil {
		return nil, err
	}
	if err := check("reg_dlist_add_desc", C.nixl_capi_reg_dlist_add_desc(reg, C.uintptr_t(base), C.size_t(blocks*blockLen), 0, nil, 0)); err != nil {
		_ = C.nixl_capi_destroy_reg_dlist(reg)
		return nil, err
	}
	if err := check("register_mem", C.nixl_capi_register_mem(n.agent, reg, nil)); err != nil {
		_ = C.nixl_capi_destroy_reg_dlist(reg)
		return nil, err
	}
	local, err := n.blockDescs(localAgent, base, blocks, blockLen)
	if err != nil {
		_ = C.nixl_capi_deregister_mem(n.agent, reg, nil)
		_ = C.nixl_capi_destroy_reg_dlist(reg)
		return nil, err
	}
	var data unsafe.Pointer
	var size C.size_t
	if err := check("get_local_md", C.nixl_capi_get_local_md(n.agent, &data, &size)); err != nil {
		_ = C.nixl_capi_release_xfer_dlist_handle(n.agent, local)
		_ = C.nixl_capi_deregister_mem(n.agent, reg, nil)
		_ = C.nixl_capi_destroy_reg_dlist(reg)
		return nil, err
	}
	// v1.4.0 returns malloc'd memory.
	md := C.GoBytes(data, C.int(size))
	C.free(data)
	n.reg, n.local, n.blocks = reg, local, blocks
	return md, nil
}

// AddRemote implements DataPlane: the peer's metadata is loaded and its
// region described block by block, so remote descriptor i is the address
// baseAddr + i*blockLen.
func (n *NIXL) AddRemote(md []byte, baseAddr uint64, numBlocks, blockLen int) (Remote, error) {
	if len(md) == 0 {
		return nil, fmt.Errorf("%w: empty agent metadata", ErrDataPlane)
	}
	if numBlocks <= 0 || blockLen <= 0 {
		return nil, fmt.Errorf("%w: %d blocks of %d bytes", ErrDataPlane, numBlocks, blockLen)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.reg == nil {
		return nil, fmt.Errorf("%w: not registered", ErrDataPlane)
	}
	var cname *C.char
	// C.CBytes copies md into C memory: NIXL must not see a Go pointer.
	cmd := C.CBytes(md)
	defer C.free(cmd)
	if err := check("load_remote_md", C.nixl_capi_load_remote_md(n.agent, cmd, C.size_t(len(md)), &cname)); err != nil {
		return nil, err
	}
	name := C.GoString(cname)
	C.free(unsafe.Pointer(cname))
	if name == n.cfg.Name {
		return nil, fmt.Errorf("%w: remote agent %q has the local agent's name", ErrDataPlane, name)
	}
	n.peers[name]++
	h, err := n.blockDescs(name, uintptr(baseAddr), numBlocks, blockLen)
	if err != nil {
		n.unload(name)
		return nil, err
	}
	return &nixlRemote{n: n, name: name, descs: h, blocks: numBlocks}, nil
}

// unload drops one use of a peer agent and invalidates its metadata when
// no Remote uses it any more. n.mu is held.
func (n *NIXL) unload(name string) {
	if n.peers[name]--; n.peers[name] > 0 {
		return
	}
	delete(n.peers, name)
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	_ = C.nixl_capi_invalidate_remote_md(n.agent, cname)
}

// Sync implements DataPlane. NIXL reports a transfer DONE only once the
// bytes are in the consumer's memory, and the consumer learns it through a
// message, so there is nothing to order.
func (n *NIXL) Sync() {}

// Close implements DataPlane: local descriptors released, memory
// deregistered, backend and agent destroyed.
func (n *NIXL) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent == nil {
		return nil
	}
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	if n.reg != nil {
		keep(check("release_xfer_dlist_handle", C.nixl_capi_release_xfer_dlist_handle(n.agent, n.local)))
		keep(check("deregister_mem", C.nixl_capi_deregister_mem(n.agent, n.reg, nil)))
		keep(check("destroy_reg_dlist", C.nixl_capi_destroy_reg_dlist(n.reg)))
		n.reg = nil
	}
	if n.backend != nil {
		keep(check("destroy_backend", C.nixl_capi_destroy_backend(n.backend)))
		n.backend = nil
	}
	keep(check("destroy_agent", C.nixl_capi_destroy_agent(n.agent)))
	n.agent = nil
	return first
}

type nixlRemote struct {
	n      *NIXL
	name   string
	descs  C.nixl_capi_xfer_dlist_handle_t
	blocks int
	closed bool
}

// Write implements Remote: one WRITE request from local blocks src to the
// peer's blocks dst, without notification, posted and polled to DONE. When
// ctx ends the request is released (NIXL cancels what it can) once it no
// longer runs.
func (r *nixlRemote) Write(ctx context.Context, src, dst []int) error {
	if len(src) != len(dst) {
		return fmt.Errorf("%w: %d sources, %d destinations", ErrDataPlane, len(src), len(dst))
	}
	if len(src) == 0 {
		return nil
	}
	n := r.n
	ls := make([]C.int, len(src))
	rs := make([]C.int, len(dst))
	for i := range src {
		if src[i] < 0 || src[i] >= n.blocks || dst[i] < 0 || dst[i] >= r.blocks {
			return fmt.Errorf("%w: block %d -> %d outside the regions", ErrDataPlane, src[i], dst[i])
		}
		ls[i], rs[i] = C.int(src[i]), C.int(dst[i])
	}
	n.mu.Lock()
	if r.closed || n.agent == nil {
		n.mu.Unlock()
		return fmt.Errorf("%w: remote %s closed", ErrDataPlane, r.name)
	}
	var req C.nixl_capi_xfer_req_t
	// The index arrays hold no Go pointers and NIXL copies them.
	st := C.nixl_capi_make_xfer_req(n.agent, C.NIXL_CAPI_XFER_OP_WRITE, n.local, &ls[0], C.size_t(len(ls)), r.descs, &rs[0], C.size_t(len(rs)), &req, nil)
	if err := check("make_xfer_req", st); err != nil {
		n.mu.Unlock()
		return err
	}
	st = C.nixl_capi_post_xfer_req(n.agent, req, nil)
	n.mu.Unlock()
	defer r.release(req)
	wait := time.Microsecond
	for {
		switch {
		case st == C.NIXL_CAPI_SUCCESS:
			return nil
		case !running(st):
			return nixlError{"transfer", st}
		}
		select {
		case <-ctx.Done():
			r.cancel(req)
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(wait*2, n.cfg.PollInterval)
		n.mu.Lock()
		st = C.nixl_capi_get_xfer_status(n.agent, req)
		n.mu.Unlock()
	}
}

// cancel stops a running request: NIXL's release aborts it where the
// backend can; otherwise wait until it is no longer in progress, so that
// nothing writes into the peer once Write returns.
func (r *nixlRemote) cancel(req C.nixl_capi_xfer_req_t) {
	n := r.n
	for {
		n.mu.Lock()
		if C.nixl_capi_release_xfer_req(n.agent, req) == C.NIXL_CAPI_SUCCESS {
			n.mu.Unlock()
			return
		}
		busy := running(C.nixl_capi_get_xfer_status(n.agent, req))
		n.mu.Unlock()
		if !busy {
			return
		}
		time.Sleep(n.cfg.PollInterval)
	}
}

// release frees a request; one that cancel already released only needs its
// wrapper destroyed.
func (r *nixlRemote) release(req C.nixl_capi_xfer_req_t) {
	n := r.n
	n.mu.Lock()
	defer n.mu.Unlock()
	_ = C.nixl_capi_release_xfer_req(n.agent, req)
	_ = C.nixl_capi_destroy_xfer_req(req)
}

// Close implements Remote: the peer's descriptors released and its
// metadata unloaded.
func (r *nixlRemote) Close() error {
	n := r.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if r.closed || n.agent == nil {
		return nil
	}
	r.closed = true
	err := check("release_xfer_dlist_handle", C.nixl_capi_release_xfer_dlist_handle(n.agent, r.descs))
	n.unload(r.name)
	return err
}
