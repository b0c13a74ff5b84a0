# kvsource: `make demo` runs the fleet replay, `make test` runs every test.
# Both install what is missing first (scripts/deps.sh).

GO       ?= go
BENCH    ?= .
BENCHTIME ?= 1s

.PHONY: all deps build test test-nixl bench demo fuzz

all: build

deps:
	@./scripts/deps.sh

build: deps
	$(GO) build ./...

test: deps
	@out=$$("$$($(GO) env GOROOT)/bin/gofmt" -l .); if [ -n "$$out" ]; then echo "gofmt wants to rewrite:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...
	$(GO) test -race -count=1 -timeout 9m ./...
	@$(MAKE) --no-print-directory test-nixl

# The nixl-tagged tests of transfer/... (vet, then with and without -race)
# against the NIXL build in ../shared/nixl, which scripts/nixl.sh extracts
# into a cache outside the checkout; said to be skipped where there is none.
NIXL_ENV = st=0; env=$$(./scripts/nixl.sh) || st=$$?; \
	if [ $$st = 2 ]; then echo "$@: NIXL skipped: no NIXL build (see above)"; exit 0; fi; \
	[ $$st = 0 ] || exit $$st; eval "$$env"
test-nixl: deps
	@set -e; $(NIXL_ENV); set -x; \
	$(GO) vet -tags nixl ./transfer/...; \
	$(GO) test -tags nixl -count=1 -run NIXL ./transfer/...; \
	$(GO) test -tags nixl -race -count=1 -run NIXL ./transfer/...

# Benchmarks and long soaks; see BENCHMARKS.md for the numbers and machine.
# The load run (TestServeLoad) drives the built kvsource serve on loopback.
bench: deps
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -benchmem -timeout 60m ./...
	KVSOURCE_LOAD=1 $(GO) test ./service -run '^TestServeLoad$$' -count 1 -v -timeout 10m
	$(GO) test -race ./index -run 'TestIndexMatches|TestReadersSee|TestAHolderID' -long -count 1 -timeout 30m
	@set -e; $(NIXL_ENV); set -x; \
	$(GO) test -tags nixl ./transfer/p2p -run '^$$' -bench 'PullLoopback' -benchtime $(BENCHTIME) -benchmem -timeout 10m

demo: deps
	$(GO) run ./examples/fleetreplay

# Short fuzzing pass over every decoder and parser (make fuzz FUZZTIME=5m for longer).
FUZZTIME ?= 30s
fuzz: deps
	$(GO) test ./hashing -run '^$$' -fuzz FuzzCBOR -fuzztime $(FUZZTIME)
	$(GO) test ./events -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)
	$(GO) test ./events -run '^$$' -fuzz FuzzValidPodName -fuzztime $(FUZZTIME)
	$(GO) test ./transfer/p2p -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)
	$(GO) test ./internal/msgpackr -run '^$$' -fuzz FuzzReader -fuzztime $(FUZZTIME)
	$(GO) test ./internal/msgpackr -run '^$$' -fuzz FuzzWords -fuzztime $(FUZZTIME)
	$(GO) test ./internal/mooncake -run '^$$' -fuzz FuzzRead -fuzztime $(FUZZTIME)
	$(GO) test ./index -run '^$$' -fuzz FuzzLoadSnapshot -fuzztime $(FUZZTIME)
	$(GO) test ./events/natsstream -run '^$$' -fuzz FuzzEscapeToken -fuzztime $(FUZZTIME)
	$(GO) test ./events/natsstream -run '^$$' -fuzz FuzzParseBatch -fuzztime $(FUZZTIME)
	$(GO) test ./events/natsstream -run '^$$' -fuzz FuzzParseSourcesTable -fuzztime $(FUZZTIME)
	$(GO) test ./service -run '^$$' -fuzz FuzzRequests -fuzztime $(FUZZTIME)
	$(GO) test ./service -run '^$$' -fuzz FuzzParsePodEndpoint -fuzztime $(FUZZTIME)
	$(GO) test ./picker/calibrate -run '^$$' -fuzz FuzzParsers -fuzztime $(FUZZTIME)
	$(GO) test ./events/natsstream -run '^$$' -fuzz FuzzJoinParts -fuzztime $(FUZZTIME)
	$(GO) test ./internal/tokjson -run '^$$' -fuzz FuzzUnmarshal -fuzztime $(FUZZTIME) -fuzzminimizetime 2s
	$(GO) test ./internal/tokjson -run '^$$' -fuzz FuzzScanTokens -fuzztime $(FUZZTIME) -fuzzminimizetime 2s
	$(GO) test ./service -run '^$$' -fuzz FuzzParseSize -fuzztime $(FUZZTIME)
	$(GO) test ./render -run '^$$' -fuzz FuzzScanBody -fuzztime $(FUZZTIME)
	$(GO) test ./render -run '^$$' -fuzz FuzzParseAnswer -fuzztime $(FUZZTIME)
	$(GO) test ./examples/eppplugin/kvplugin -run '^$$' -fuzz FuzzPrefixParameters -fuzztime $(FUZZTIME)
	$(GO) test ./picker/kvhints -run '^$$' -fuzz FuzzHintEncoders -fuzztime $(FUZZTIME)
	$(GO) test ./service -run '^$$' -fuzz FuzzParseKVCRFlags -fuzztime $(FUZZTIME)
	$(GO) test ./internal/jsonw -run '^$$' -fuzz FuzzAppendString -fuzztime $(FUZZTIME)
