package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/internal/faultengine"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// The failure matrix: every way an engine misbehaves (faultengine's faults, down to the byte
// and the moment), on either leg, of either engine protocol, streamed or not, on completions,
// chat, the Responses and Messages APIs and vLLM's token-in generate route, with a client
// that waits for its answer or leaves the moment the fault strikes (before any byte of it
// reached the proxy). Every cell must end this way: the
// client gets an answer it can parse (an OpenAI-shape error before the first byte, an error
// event and no [DONE] once a stream began, a cut connection for a JSON answer under way) or a
// whole, correct answer where the fault can be served around, and a client that leaves has
// left; the fault struck; nothing panics; nothing is left in the table, in flight or held; a
// hold's params reach one decoder at most, whatever the engine kind; explicit aborts come in
// their order (SGLang's legs decoder first, sim's prefiller only once no decode can carry
// the hold); and the faulty engine is charged with its failure where it was one, no other
// engine ever.
//
// Its migrate/ cells (migrationCells) run the decoder's faults after the first byte with
// migration on: a stream that can go on elsewhere must read as one unbroken answer instead.
//
// CI runs every fault, leg, engine and client behaviour, with stream and route paired
// (each fault sees both); PDPROXY_MATRIX=full crosses all of them.

type matrixCell struct {
	proto faultengine.Protocol
	// kind is the engine kind the proxy is told: vllm (sequential, no explicit abort), sim
	// (sequential, with SGLang's explicit abort), or sglang (paired legs).
	kind   string
	leg    string // "prefill" or "decode"
	fault  faultengine.Fault
	stream bool
	route  string // completions, chat, responses, messages or generate (vLLM's token-in route)
	leave  bool
	// pass: the request is an embedding, which one decoder answers without P/D (leg is then
	// "decode", stream and chat false).
	pass bool
	// migrate: the proxy runs with migration_limit 3, and the fault is the decoder's, after
	// the client's first byte (migrationCells).
	migrate bool
	// unmovable is what the request asks that keeps its stream from moving ("n2", a
	// json_schema response_format, logprobs), "" for nothing.
	unmovable string
	// leaveIn is, in a migration cell whose client leaves, the leg of the continuation
	// ("prefill" or "decode") whose arrival at its engine the client leaves on, rather than
	// at the fault.
	leaveIn string
	// placed: both pools on cache_aware behind a shared state (a real Redis) whose placements
	// name the faulty engine for the request's prompt, which is long enough to have heads:
	// the pick the placements steer meets the fault (placedCells).
	placed bool
}

func (c matrixCell) name() string {
	route := c.route
	mode := "json"
	if c.stream {
		mode = "stream"
	}
	client := "stays"
	if c.leave {
		client = "leaves"
	}
	if c.migrate {
		if c.leaveIn != "" {
			client = "leaves_in_continuation_" + c.leaveIn
		}
		if c.unmovable != "" {
			route += "_" + c.unmovable
		}
		return fmt.Sprintf("migrate/%s/%s/%s/%s/%s/client_%s", c.kind, c.leg, c.fault, mode, route, client)
	}
	if c.placed {
		return fmt.Sprintf("placed/%s/%s/%s/%s/%s/client_%s", c.kind, c.leg, c.fault, mode, route, client)
	}
	return fmt.Sprintf("%s/%s/%s/%s/%s/client_%s", c.kind, c.leg, c.fault, mode, route, client)
}

// matrixCells is the matrix, whole or with stream and route paired.
func matrixCells(full bool) []matrixCell {
	var cells []matrixCell
	for _, kind := range []string{"vllm", "sim", "sglang", "mooncake"} {
		proto := faultengine.VLLM
		switch kind {
		case "sglang":
			proto = faultengine.SGLang
		case "mooncake":
			proto = faultengine.Mooncake
		}
		for _, leg := range []string{"prefill", "decode"} {
			for _, fault := range faultengine.Faults() {
				if fault == faultengine.BadParams && (leg != "prefill" || proto != faultengine.VLLM) {
					continue // only a vLLM prefiller answers with params
				}
				for _, leave := range []bool{false, true} {
					if leave && fault == faultengine.LateEnd && leg == "prefill" && proto != faultengine.VLLM {
						// A paired prefiller's end comes after its room's transfer, when the
						// decoder's answer may be whole already: no client can leave on it.
						continue
					}
					for _, stream := range []bool{false, true} {
						for _, route := range []string{"completions", "chat", "responses", "messages", "generate"} {
							if route == "generate" && proto == faultengine.SGLang {
								continue // SGLang has no token-in route: refused before any leg
							}
							// CI pairs stream and route: completions streamed, chat and
							// responses not, responses, messages and generate streamed too
							// (their ends, error events and bounds are their own).
							typed := route == "responses" || route == "messages" || route == "generate"
							if !full && (route == "completions") != stream && !typed {
								continue
							}
							if !full && typed && !stream {
								continue
							}
							cells = append(cells, matrixCell{proto: proto, kind: kind, leg: leg, fault: fault, stream: stream, route: route, leave: leave})
						}
					}
				}
			}
		}
		// The faults only a stream has meet the decoder's streams; CI takes completions and
		// responses.
		for _, fault := range faultengine.StreamFaults() {
			for _, leave := range []bool{false, true} {
				for _, route := range []string{"completions", "chat", "responses", "messages", "generate"} {
					if fault == faultengine.MidError && (route == "responses" || route == "messages") || !full && route == "chat" {
						continue // vLLM's error event is a completion's, a chat's or a generate stream's
					}
					if route == "generate" && proto == faultengine.SGLang {
						continue
					}
					cells = append(cells, matrixCell{proto: proto, kind: kind, leg: "decode", fault: fault, stream: true, route: route, leave: leave})
				}
			}
		}
	}
	// A passthrough route meets every fault of a single call.
	for _, fault := range faultengine.Faults() {
		if fault == faultengine.BadParams {
			continue
		}
		for _, leave := range []bool{false, true} {
			cells = append(cells, matrixCell{proto: faultengine.VLLM, kind: "vllm", leg: "decode", fault: fault, leave: leave, route: "embeddings", pass: true})
		}
	}
	return append(append(cells, migrationCells(full)...), placedCells()...)
}

// placedCells are every fault of either leg of a vLLM and an SGLang pair, with a client that
// stays and one that leaves, on a completions stream, picked by cache_aware as the replicas'
// shared placements steer it: to the faulty engine.
func placedCells() []matrixCell {
	var cells []matrixCell
	for _, proto := range []faultengine.Protocol{faultengine.VLLM, faultengine.SGLang} {
		for _, leg := range []string{"prefill", "decode"} {
			for _, fault := range faultengine.Faults() {
				if fault == faultengine.BadParams && (leg != "prefill" || proto != faultengine.VLLM) {
					continue
				}
				for _, leave := range []bool{false, true} {
					if leave && fault == faultengine.LateEnd && leg == "prefill" && proto != faultengine.VLLM {
						continue // as in matrixCells: no client can leave on it
					}
					cells = append(cells, matrixCell{proto: proto, kind: string(proto), leg: leg, fault: fault, stream: true,
						route: "completions", leave: leave, placed: true})
				}
			}
		}
	}
	return cells
}

// midStreamFaults are the decoder's faults that strike after the client's first byte of a
// stream: those that break it (and move it, with migration), the one that ends it whole but
// for its [DONE] (after its finish_reason: nothing is left to move), and one that is served.
var midStreamFaults = []faultengine.Fault{faultengine.MidClose, faultengine.MidReset, faultengine.MidSilence,
	faultengine.ShortStream, faultengine.MidError, faultengine.NoDone, faultengine.LateEnd}

// migrationCells are the cells of a decoder that fails after the client's first byte, with
// migration on: every engine kind, every mid-stream fault, completions and chat streams. A
// stream on an engine that can continue goes on on the other decoder (under P/D with a new
// prefill) and the client reads one whole answer, or leaves as the continuation's prefill or
// decode reaches its engine; a stream on SGLang, a Responses stream, and a request that asks
// for what a continuation cannot reproduce fail as without migration. CI pairs each leaving
// moment with one route, and takes the requests that cannot move on completions, as
// PDPROXY_MATRIX=full crosses them.
func migrationCells(full bool) []matrixCell {
	var cells []matrixCell
	add := func(c matrixCell) {
		c.proto, c.leg, c.stream, c.migrate = faultengine.VLLM, "decode", true, true
		switch c.kind {
		case "sglang":
			c.proto = faultengine.SGLang
		case "mooncake":
			c.proto = faultengine.Mooncake
		}
		c.leave = c.leaveIn != ""
		cells = append(cells, c)
	}
	for _, kind := range []string{"vllm", "sim", "mooncake", "sglang"} {
		for _, fault := range midStreamFaults {
			for _, route := range []string{"completions", "chat"} {
				add(matrixCell{kind: kind, fault: fault, route: route})
				for _, leaveIn := range []string{"prefill", "decode"} {
					pairs := (leaveIn == "prefill") == (route == "completions")
					c := matrixCell{kind: kind, fault: fault, route: route, leaveIn: leaveIn}
					if c.movesOn() && (full || pairs) {
						add(c)
					}
				}
				for _, unmovable := range []string{"n2", "json_schema", "logprobs"} {
					if kind != "sglang" && fault != faultengine.LateEnd && fault != faultengine.NoDone && (full || route == "completions") {
						add(matrixCell{kind: kind, fault: fault, route: route, unmovable: unmovable})
					}
				}
			}
			if kind != "sglang" && fault != faultengine.MidError && fault != faultengine.LateEnd {
				// A Responses stream never moves, wherever its decoder breaks it (vLLM's
				// error event is a completion's or a chat's).
				add(matrixCell{kind: kind, fault: fault, route: "responses"})
			}
		}
	}
	return cells
}

// movesOn reports whether migration cell c's stream goes on on another decoder: its engine
// can continue from ids, it asks for nothing a continuation could not reproduce, and its
// decoder breaks it before its finish_reason.
func (c matrixCell) movesOn() bool {
	if c.kind == "sglang" || c.unmovable != "" || c.route == "responses" || c.route == "messages" {
		return false
	}
	switch c.fault {
	case faultengine.NoDone, faultengine.LateEnd:
		return false
	}
	return true
}

func TestFailureMatrix(t *testing.T) {
	cells := matrixCells(os.Getenv("PDPROXY_MATRIX") == "full")
	// The placed cells' shared state: one server, a key prefix per cell.
	var redis struct {
		once sync.Once
		addr string
	}
	redisAddr := func() string {
		redis.once.Do(func() { redis.addr = redistest.Start(t).Addr() })
		return redis.addr
	}
	start := time.Now()
	var ran atomic.Int64 // the cells -run selected
	t.Cleanup(func() {
		t.Logf("%d of %d cells in %v", ran.Load(), len(cells), time.Since(start).Round(time.Millisecond))
	})
	for _, c := range cells {
		addr := ""
		if c.placed {
			addr = redisAddr() // started by the test, not by a parallel cell that ends first
		}
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			ran.Add(1)
			runCell(t, c, addr)
		})
	}
}

// outcome is what a cell's client may see.
type outcome int

const (
	served outcome = iota // a whole, correct answer
	failed                // a clear failure
	either                // the fault's moment decides: a clear failure or a whole answer
	// passedOn: the engine's own error event, as it came, and what the engine sent after it
	// (vLLM's [DONE]): without migration the proxy does not read a stream's events.
	passedOn
)

// expected is what a client that stays must see in cell c, and, for a failure before any
// byte, the status.
func (c matrixCell) expected() (outcome, int) {
	f := c.fault
	if c.migrate {
		if c.movesOn() || f == faultengine.LateEnd {
			return served, 200
		}
		return failed, 0 // an error event, as without migration
	}
	switch f {
	case faultengine.BigHeaders, faultengine.KeepAliveReset, faultengine.LateEnd:
		// LateEnd's pause is longer than client_write_timeout, shorter than the idle one.
		return served, 200
	}
	if c.leg == "prefill" {
		switch f {
		case faultengine.Status400, faultengine.Status400Huge:
			return failed, 400
		case faultengine.Status422Empty:
			return failed, 422
		}
		if c.proto == faultengine.VLLM {
			// Nobody prefilled: the decoder computes the prompt itself.
			return served, 200
		}
		if sendsHead(f) {
			// The room's KV went to the decoder before the prefiller's answer broke.
			return either, 0
		}
		return failed, 0
	}
	if c.recovers() {
		return served, 200
	}
	switch f {
	case faultengine.Status400, faultengine.Status400Huge:
		return failed, 400
	case faultengine.Status422Empty:
		return failed, 422
	case faultengine.Status500, faultengine.Status503, faultengine.CloseAfterRead, faultengine.HeadersThenClose,
		faultengine.HeadersThenReset, faultengine.EmptyClose:
		return failed, http.StatusBadGateway
	case faultengine.Silent, faultengine.HeadersThenSilence:
		return failed, http.StatusGatewayTimeout
	case faultengine.NoDone:
		if !c.stream {
			return served, 200 // a JSON answer ends whole
		}
	case faultengine.MidError:
		return passedOn, 0
	}
	return failed, 0 // mid-answer: after the status line
}

// recovers reports whether the client of cell c is served around a decoder that failed before
// the first byte reached the client: on a fresh pair, with the faulty decoder left out. A
// decoder whose connection broke, or whose answer ended empty, lost the request; a 5xx to a
// decode that carried the prefiller's KV is a failed pull, and the request is prefilled again.
func (c matrixCell) recovers() bool {
	if c.leg != "decode" {
		return false
	}
	switch c.fault {
	case faultengine.CloseAfterRead, faultengine.HeadersThenClose, faultengine.HeadersThenReset, faultengine.EmptyClose:
		return true
	case faultengine.Status500, faultengine.Status503:
		return c.proto == faultengine.VLLM && !c.pass
	case faultengine.MidClose, faultengine.MidReset:
		// An answer the proxy converts only once it is whole (SGLang's Messages, served by
		// its chat route) breaks before the client's first byte.
		return c.convertedWhole()
	}
	return false
}

// convertedWhole reports whether cell c's answer reaches its client only once the decoder's is
// whole: a Messages answer, not streamed, from an engine that serves Messages by chat (SGLang).
func (c matrixCell) convertedWhole() bool {
	return c.route == "messages" && !c.stream && c.proto == faultengine.SGLang
}

func sendsHead(f faultengine.Fault) bool {
	switch f {
	case faultengine.Status500, faultengine.Status503, faultengine.Status400, faultengine.Status400Huge,
		faultengine.Status422Empty, faultengine.CloseAfterRead, faultengine.Silent:
		return false
	}
	return true
}

func runCell(t *testing.T, c matrixCell, redisAddr string) {
	rooms := faultengine.NewRooms()
	lv := &leaver{}
	start := func(prefill bool, fault faultengine.Fault) *faultengine.Engine {
		arrived := func(r faultengine.Request) { lv.arrived(prefill, r) }
		e, err := faultengine.Start(faultengine.Config{Protocol: c.proto, Prefill: prefill, Fault: fault, Rooms: rooms, OnFault: lv.strike, OnGenerate: arrived})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		return e
	}
	pf, df := faultengine.None, faultengine.None
	if c.leg == "prefill" {
		pf = c.fault
	} else {
		df = c.fault
	}
	p := start(true, pf)
	d0 := start(false, df)
	// A second decoder, where a drain, a retry, or a bug, could send a hold's params.
	d1 := start(false, faultengine.None)
	engines := map[string]*faultengine.Engine{"p0": p, "d0": d0, "d1": d1}
	faultyName := map[string]string{"prefill": "p0", "decode": "d0"}[c.leg]
	faulty := engines[faultyName]
	backends := []routerconfig.BackendConfig{prefiller("p0", p.URL()), decoder("d0", d0.URL()), decoder("d1", d1.URL())}
	backends[1].Weight = 2 // least_inflight's ties go to the heavier: the faulty decoder is tried first
	for i := range backends {
		backends[i].Engine = c.kind
	}
	if c.proto != faultengine.VLLM {
		backends[0].BootstrapPort = 8998
		if c.proto == faultengine.Mooncake {
			// Its bootstrap server's /query is served on the engine's own port.
			u, _ := url.Parse(p.URL())
			backends[0].BootstrapPort, _ = strconv.Atoi(u.Port())
		}
	}
	cfg := Config{
		PrefillTimeout:         400 * time.Millisecond,
		DecodeFirstByteTimeout: 400 * time.Millisecond,
		DecodeIdleTimeout:      400 * time.Millisecond,
		// Shorter than the silences above: the error event must still reach the client.
		ClientWriteTimeout: 150 * time.Millisecond,
		DrainTimeout:       time.Second,
	}
	if c.migrate {
		cfg.MigrationLimit = 3
	}
	rcfg := routerconfig.Config{Backends: backends}
	var opts []Option
	var store *sharedstate.Store
	if c.placed {
		rcfg.PrefillPolicy, rcfg.DecodePolicy, rcfg.SharedPlacements = routerconfig.PolicyCacheAware, routerconfig.PolicyCacheAware, true
		store, _ = sharedStore(t, redisAddr, fmt.Sprintf("cell-%x:", xxhash.Sum64String(c.name()))) // a key prefix of the cell's own
		opts = append(opts, WithSharedState(store))
	}
	h := newHarnessLogged(t, cfg, rcfg, lifecycle.Config{}, nil, opts...)

	path := "/v1/completions"
	body := `{"model":"m","prompt":"hello there","max_tokens":8`
	switch c.route {
	case "chat":
		path = "/v1/chat/completions"
		body = `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":8`
	case "responses":
		path = "/v1/responses"
		body = `{"model":"m","input":[{"role":"user","content":"hello there"}],"max_output_tokens":8`
	case "messages":
		path = "/v1/messages"
		body = `{"model":"m","system":"be brief","messages":[{"role":"user","content":"hello there"}],"max_tokens":8`
	case "generate":
		path = api.GenerateRoute
		body = `{"model":"m","token_ids":[104,101,108,108,111],"sampling_params":{"max_tokens":8}`
	}
	if c.stream {
		body += `,"stream":true`
	}
	switch c.unmovable {
	case "n2":
		body += `,"n":2`
	case "json_schema":
		body += `,"response_format":{"type":"json_schema","json_schema":{"name":"answer","schema":{"type":"object"}}}`
	case "logprobs":
		if c.route == "chat" {
			body += `,"logprobs":true,"top_logprobs":1`
		} else {
			body += `,"logprobs":1`
		}
	}
	body += "}"
	if c.pass {
		path, body = "/v1/embeddings", `{"model":"m","input":"hello there"}`
	}
	if c.placed {
		body = strings.Replace(body, `"hello there"`, strconv.Quote(placedPrompt), 1)
		placeOn(t, h, store, map[routerconfig.Role]string{routerconfig.RolePrefill: "p0", routerconfig.RoleDecode: "d0"})
	}

	if c.fault == faultengine.KeepAliveReset {
		// The connection the fault resets must be one kept open from an earlier request: the
		// warm-up's, back in the proxy's pool once its leases are given back (a response body
		// read to its end returns its connection to the pool before the read returns).
		if got := matrixCall(t, h, path, body, nil); got.err != nil || got.status != 200 {
			t.Fatalf("warm-up request: status %d, %v", got.status, got.err)
		}
		h.waitQuiet()
	}

	if c.leave {
		lv.arm(h, !c.proxyAwaitsFault(), c.leaveIn)
	}
	got := matrixCall(t, h, path, body, lv)

	if c.leave {
		if !got.left {
			t.Errorf("the client was to leave as the fault struck, yet its call ended on its own: status %d (%v): %s", got.status, got.err, testutil.Clip(got.body))
		}
	} else {
		want, status := c.expected()
		got.check(t, c, want, status)
		if c.fault == faultengine.BigHeaders || c.fault == faultengine.KeepAliveReset {
			// Served around the fault with P/D, not by a decode-only fallback that leaves
			// the prefilled KV to the engine's lease.
			if n := h.value("pdproxy_fallbacks_total", nil); n != 0 {
				t.Errorf("%v decode-only fallbacks", n)
			}
		}
	}
	if c.migrate {
		migrationChecks(t, c, h, got, d0)
	}
	if c.placed {
		// The faulty engine's pool read the placements: its pick credited the engine they
		// name with the prompt's head, most of the prompt.
		if r, _ := testutil.HistogramOf(t, h.reg, "pdproxy_prefix_cache_match_ratio", map[string]string{"role": c.leg}); r.Sum < 0.5 {
			t.Errorf("the %s picks' predicted shares add up to %v (of %d picks): the placements did not steer them", c.leg, r.Sum, r.Count)
		}
	}

	// Nothing is left behind, whatever the client saw.
	h.waitQuiet()
	eventually(t, "every KV hold released", func() bool {
		return h.table.OutstandingHolds() == 0 && h.value("pdproxy_kv_held_requests", nil) == 0
	})
	if n := h.value("pdproxy_panics_total", nil); n != 0 {
		t.Errorf("%v panics", n)
	}
	select {
	case <-faulty.Faulted():
	default:
		t.Errorf("the %s engine never performed its fault", faultyName)
	}
	paramsAtOneDecoder(t, c, d0, d1)
	switch c.kind {
	case "sglang":
		legsAbortedDecoderFirst(t, c, p, d0, got)
	case "sim":
		abortsAfterDecodes(t, c, p, d0, d1)
	case "mooncake":
		// Its engine has no explicit abort: the proxy aborts its legs by cancelling both
		// calls, the decoder's first, but each connection is then closed by its own
		// goroutine of the transport, so the order in which the engines see the closes is
		// not one the proxy can promise, nor one a test can observe without a race. What
		// must hold is that no abort call is sent to an engine that has none.
		for name, e := range engines {
			for _, r := range e.Requests() {
				if r.Path == "/abort_request" {
					t.Errorf("%s, a Mooncake engine, was sent an explicit abort", name)
				}
			}
		}
	}
	// Only the faulty engine is charged with a failure, and it is when the failure was its.
	for _, b := range backends {
		n := failuresCharged(h, b.Name)
		switch {
		case b.Name != faultyName && n != 0:
			t.Errorf("healthy backend %s was charged %v failures", b.Name, n)
		case b.Name != faultyName:
		case c.charged() == blamed && n == 0:
			t.Errorf("faulty backend %s was charged no failure", b.Name)
		case c.charged() == notBlamed && n != 0:
			t.Errorf("backend %s was charged %v failures for a fault that is not its failure", b.Name, n)
		}
	}
}

// placedPrompt is the placed cells' prompt: long enough for a head of its own.
var placedPrompt = "hello there. " + strings.Repeat("A preamble the replicas have placed before. ", 30)

// placeOn writes, as another replica's picks would have, that the placed prompt's heads went
// to the engine given for each role, and waits until they read back.
func placeOn(t *testing.T, h *harness, st *sharedstate.Store, on map[routerconfig.Role]string) {
	t.Helper()
	for role, engine := range on {
		heads, ttl := h.rt.Heads(role, router.Hint{Text: placedPrompt, Model: "m"}, nil)
		if len(heads) == 0 {
			t.Fatalf("the placed prompt has no heads for the %s pool", role)
		}
		keys := make([]sharedstate.Head, len(heads))
		for i, hd := range heads {
			keys[i] = sharedstate.Head{Role: string(role), Key: hd.Key}
			st.Place(keys[i], engine, ttl)
		}
		eventually(t, "the placements of the "+string(role)+" pool in the shared state", func() bool {
			got, _, err := st.Placements(context.Background(), keys, nil)
			return err == nil && len(got) == len(keys) && !slices.ContainsFunc(got, func(e string) bool { return e != engine })
		})
	}
}

// continuation reports whether r is a continuation's call: a completions prompt of ids.
func continuation(r faultengine.Request) bool {
	p := bytes.TrimSpace(r.Field("prompt"))
	return len(p) > 0 && p[0] == '['
}

// migrationChecks asserts what migration cell c shows beyond the matrix's end checks, each in
// a subtest named for what it checks. A stream that moved reads as the unbroken answer, token
// for token, one stream, with no ids the client did not ask for; it is counted once as
// migrated, by why, with the two tokens the client had replayed; its faulty decoder had one
// call of it. One that could not move is counted once as not_migratable, and its refusal by
// why. One whose decoder did not break it, or that cannot move at all (a Responses stream),
// is counted nowhere.
func migrationChecks(t *testing.T, c matrixCell, h *harness, got matrixResult, faulty *faultengine.Engine) {
	t.Helper()
	reason := "decoder_failed"
	switch c.fault {
	case faultengine.MidSilence:
		reason = "idle_timeout"
	case faultengine.MidError:
		reason = "error_event"
	}
	total := h.value("pdproxy_migrations_total", nil)
	refused := h.value("pdproxy_migrations_refused_total", nil)
	switch {
	case c.movesOn():
		t.Run("counted_migrated_"+reason, func(t *testing.T) {
			if n := h.value("pdproxy_migrations_total", map[string]string{"reason": reason, "outcome": "migrated"}); n != 1 || total != 1 {
				t.Errorf("migrations{%s,migrated} = %v of %v in all, want the one", reason, n, total)
			}
			if n := h.value("pdproxy_migration_tokens_replayed_total", nil); n != 2 {
				t.Errorf("%v tokens replayed, want the 2 the client had", n)
			}
		})
		t.Run("never_back_to_the_faulty_decoder", func(t *testing.T) {
			calls := 0
			for _, r := range faulty.Requests() {
				if r.Path != "/abort_request" {
					calls++
				}
			}
			if calls != 1 {
				t.Errorf("the faulty decoder had %d calls, want 1", calls)
			}
		})
		if c.leave {
			return
		}
		t.Run("one_unbroken_answer", func(t *testing.T) { oneAnswer(t, c, got.body) })
		t.Run("no_token_ids_the_client_did_not_ask_for", func(t *testing.T) { noUnaskedIDs(t, got.body) })
	case c.fault == faultengine.LateEnd || c.route == "responses":
		t.Run("counted_nowhere", func(t *testing.T) {
			if total != 0 || refused != 0 {
				t.Errorf("%v migrations and %v refusals counted for a stream that does not move", total, refused)
			}
		})
		if c.fault == faultengine.LateEnd {
			// Whole, not moved: the ids asked for in case it would were taken out all the same.
			t.Run("no_token_ids_the_client_did_not_ask_for", func(t *testing.T) { noUnaskedIDs(t, got.body) })
		}
	default:
		why := map[string]string{"n2": "n", "json_schema": "guided_decoding", "logprobs": "logprobs"}[c.unmovable]
		switch {
		case c.fault == faultengine.NoDone:
			why = "finished"
		case c.kind == "sglang":
			why = "engine"
		}
		t.Run("counted_not_migratable_"+reason+"_refused_"+why, func(t *testing.T) {
			if n := h.value("pdproxy_migrations_total", map[string]string{"reason": reason, "outcome": "not_migratable"}); n != 1 || total != 1 {
				t.Errorf("migrations{%s,not_migratable} = %v of %v in all, want the one", reason, n, total)
			}
			if n := h.value("pdproxy_migrations_refused_total", map[string]string{"reason": why}); n != 1 || refused != 1 {
				var by []string
				for _, r := range []string{"n", "prompt_array", "guided_decoding", "logprobs", "tools", "penalties", "stop", "engine", "too_long", "no_token_ids", "finished", "no_tokens_left"} {
					if v := h.value("pdproxy_migrations_refused_total", map[string]string{"reason": r}); v != 0 {
						by = append(by, fmt.Sprintf("%s=%v", r, v))
					}
				}
				t.Errorf("migrations_refused{%s} = %v, want 1 and no other; counted: %v", why, n, by)
			}
		})
	}
}

// oneAnswer checks that a stream that moved reads as the fault engine's unbroken one: its 4
// tokens t0 to t3 in order, as events of the first answer's (one id; a chat's as chat
// chunks), one finish_reason, then [DONE].
func oneAnswer(t *testing.T, c matrixCell, body []byte) {
	t.Helper()
	events := testutil.SSEDispatched(body)
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("the stream did not end with [DONE]: %s", testutil.Clip(body))
	}
	var text strings.Builder
	ids := map[string]bool{}
	finishes := 0
	for _, ev := range events[:len(events)-1] {
		var v struct {
			ID      json.RawMessage `json:"id"`
			Object  string          `json:"object"`
			Choices []struct {
				Text   string `json:"text"`
				Delta  struct{ Content string }
				Finish *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &v); err != nil {
			t.Fatalf("event %q: %v", ev, err)
		}
		ids[string(v.ID)] = true
		if want := map[bool]string{true: "chat.completion.chunk", false: "text_completion"}[c.route == "chat"]; v.Object != want {
			t.Errorf("an event is a %q, want %q: %s", v.Object, want, ev)
		}
		for _, ch := range v.Choices {
			text.WriteString(ch.Text + ch.Delta.Content)
			if ch.Finish != nil {
				finishes++
			}
		}
	}
	if got := text.String(); got != "t0t1t2t3" {
		t.Errorf("the client read %q, want the unbroken answer t0t1t2t3: %s", got, testutil.Clip(body))
	}
	if len(ids) != 1 || finishes != 1 {
		t.Errorf("%d ids and %d finish reasons, want one of each: %s", len(ids), finishes, testutil.Clip(body))
	}
}

// noUnaskedIDs checks that no event of a stream whose client did not ask for token ids
// carries them: the proxy asked for them to be able to move the stream, and takes them out,
// the prompt's (a chat's at the top of its first chunk, a completion's on its first choice)
// and the generated ones (on each choice).
func noUnaskedIDs(t *testing.T, body []byte) {
	t.Helper()
	for _, ev := range testutil.SSEDispatched(body) {
		if ev == "[DONE]" {
			continue
		}
		var v struct {
			Prompt  json.RawMessage `json:"prompt_token_ids"`
			Choices []struct {
				IDs    json.RawMessage `json:"token_ids"`
				Prompt json.RawMessage `json:"prompt_token_ids"`
			} `json:"choices"`
		}
		json.Unmarshal([]byte(ev), &v)
		bad := v.Prompt != nil
		for _, ch := range v.Choices {
			bad = bad || ch.IDs != nil || ch.Prompt != nil
		}
		if bad {
			t.Errorf("an event carries token ids the client did not ask for: %s", ev)
		}
	}
}

// failuresCharged is how many of backend's calls the router counted as its failures: a
// transport error or a 5xx (pdproxy_backend_requests_total), what passive health ejects on.
func failuresCharged(h *harness, backend string) float64 {
	var n float64
	for _, code := range []string{"error", "500", "502", "503", "504"} {
		n += h.value("pdproxy_backend_requests_total", map[string]string{"backend": backend, "code": code})
	}
	return n
}

// blame is whether a failure must be charged to the faulty engine.
type blame int

const (
	blamed    blame = iota
	notBlamed       // the fault is no failure of the engine, or the proxy does not hold it to it
	// eitherBlame: two events race (two timeouts of the same length, an engine's answer and
	// the client's leaving), and the one the proxy sees first says whether the engine is at
	// fault.
	eitherBlame
)

// charged is whether the faulty engine of cell c must be charged with a failure (a transport
// error or a 5xx in pdproxy_backend_requests_total, what passive health ejects on).
func (c matrixCell) charged() blame {
	if c.migrate {
		if c.fault == faultengine.LateEnd {
			return notBlamed // served
		}
		// The decoder broke the stream, whatever came of it; a client that leaves during the
		// continuation leaves after that.
		return blamed
	}
	if c.leave {
		if c.proxyAwaitsFault() && (c.fault == faultengine.Status500 || c.fault == faultengine.Status503) {
			// The proxy waits for the decoder's word, a 5xx, which is charged unless the
			// proxy saw the client leave first; both happen at once.
			return eitherBlame
		}
		return notBlamed // a client that leaves is no engine's failure
	}
	paired := c.proto != faultengine.VLLM
	switch c.fault {
	case faultengine.BigHeaders, faultengine.KeepAliveReset, faultengine.LateEnd:
		return notBlamed // served around
	case faultengine.Status400, faultengine.Status400Huge, faultengine.Status422Empty:
		return notBlamed // the engine's verdict on the request, not its failure
	case faultengine.MidError:
		return notBlamed // passed on unread (passedOn)
	case faultengine.NoDone:
		if c.leg == "prefill" || !c.stream {
			return notBlamed // a JSON answer ends whole
		}
	case faultengine.HeadersThenClose, faultengine.HeadersThenReset, faultengine.MidClose, faultengine.MidReset:
		if paired && c.leg == "prefill" {
			// The prefill leg breaks after its head, as the decoder serves the client: a
			// break the proxy sees once the request ended is judged against the ended
			// request's context, and not charged.
			return eitherBlame
		}
	case faultengine.EmptyClose, faultengine.MidSilence:
		if paired && c.leg == "prefill" {
			// A paired prefiller's answer is read and dropped: once its head is out, the
			// room's KV went to the decoder, which serves the client.
			return notBlamed
		}
	case faultengine.HeadersThenSilence:
		if paired {
			// The same for a prefiller; a paired decoder's head does not say it has the KV,
			// and silent after it, the decoder may be waiting on the prefiller.
			return notBlamed
		}
	case faultengine.Silent:
		switch {
		case c.proto == faultengine.Mooncake && c.leg == "decode":
			// A Mooncake prefiller answers before its transfer: a decoder silent before its
			// first byte may be waiting on the KV, and is not blamed for it.
			return notBlamed
		case paired && c.leg == "prefill":
			// The decoder waits for the room the silent prefiller never fills:
			// prefill_timeout (the prefiller's fault) and decode_first_byte_timeout (the
			// decoder's wait, blamed on nobody) are the same here.
			return eitherBlame
		}
	}
	return blamed
}

// proxyAwaitsFault reports whether the proxy, by design, goes on waiting for the faulty engine
// after the client left: a sequential decode that carries a hold is cut only once its decoder
// acknowledges it (or after a grace), so that the proxy learns whether the decoder has the
// params, and these faults answer, or reset the connection, without acknowledging.
func (c matrixCell) proxyAwaitsFault() bool {
	if c.proto != faultengine.VLLM || c.leg != "decode" || c.pass {
		return false
	}
	switch c.fault {
	case faultengine.Status500, faultengine.Status503, faultengine.KeepAliveReset:
		return true
	}
	return false
}

// leaver is a client that leaves the moment an engine performs its fault: the engine's
// OnFault cancels the client's call and waits until the call is over and the proxy has
// finished the request, so that the client is gone, and the proxy knows it, before anything
// of the fault reached the proxy. Unarmed (a client that stays, a warm-up), it does nothing.
type leaver struct {
	mu sync.Mutex
	h  *harness
	// awaitProxy: the engine goes on only once the proxy finished the request; false where
	// the proxy waits for the engine's answer by design (matrixCell.proxyAwaitsFault).
	awaitProxy bool
	before     float64 // requests the proxy had finished when it was armed
	// leaveIn: the call leaves as the continuation's leg of that name reaches its engine
	// (arrived), not at a fault.
	leaveIn string
	cancel  context.CancelFunc
	done    chan struct{} // closed once the call is over
	struck  bool
}

// arm makes the next call leave at the next fault, or, with leaveIn, as its continuation's
// prefill or decode reaches its engine.
func (l *leaver) arm(h *harness, awaitProxy bool, leaveIn string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.h, l.awaitProxy, l.before, l.leaveIn = h, awaitProxy, finishedRequests(h), leaveIn
}

// start hands the leaver the call's cancel; it returns the channel to close once the call is
// over, nil when unarmed.
func (l *leaver) start(cancel context.CancelFunc) chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h == nil {
		return nil
	}
	l.cancel, l.done = cancel, make(chan struct{})
	return l.done
}

// left reports whether the call was cancelled by a fault.
func (l *leaver) left() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.struck
}

// strike is the engines' OnFault.
func (l *leaver) strike(faultengine.Fault) {
	l.mu.Lock()
	atFault := l.leaveIn == ""
	l.mu.Unlock()
	if atFault {
		l.leave()
	}
}

// arrived is the engines' OnGenerate: a prefiller's (prefill) or a decoder's request r.
func (l *leaver) arrived(prefill bool, r faultengine.Request) {
	leg := "decode"
	if prefill {
		leg = "prefill"
	}
	l.mu.Lock()
	at := l.leaveIn
	l.mu.Unlock()
	if at == leg && continuation(r) {
		l.leave()
	}
}

// leave cancels the armed call, once, and returns when the call is over and, with
// awaitProxy, the proxy has finished the request.
func (l *leaver) leave() {
	l.mu.Lock()
	armed := l.cancel != nil && !l.struck
	if armed {
		l.struck = true
	}
	h, awaitProxy, before, cancel, done := l.h, l.awaitProxy, l.before, l.cancel, l.done
	l.mu.Unlock()
	if !armed {
		return
	}
	cancel()
	deadline := time.After(testDeadline)
	select {
	case <-done:
	case <-deadline:
		return
	}
	if !awaitProxy {
		return
	}
	// The proxy has no signal for a request it finished but its metrics: they are polled.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for finishedRequests(h) <= before {
		select {
		case <-tick.C:
		case <-deadline:
			return
		}
	}
}

// finishedRequests is how many requests the proxy has answered (pdproxy_requests_total, 499s
// included). It may run off the test's goroutine, so it never fails the test itself: an
// unreadable registry reads as none.
func finishedRequests(h *harness) float64 {
	mfs, err := h.reg.Gather()
	if err != nil {
		return 0
	}
	n, _ := testutil.Sum(mfs, "pdproxy_requests_total", nil)
	return n
}

// matrixResult is what the client got.
type matrixResult struct {
	status int
	ctype  string
	body   []byte
	err    error // the answer could not be read to its end
	left   bool  // the client left as the fault struck, before its answer was whole
}

// matrixCall sends one request; with lv armed, the client leaves when an engine performs its
// fault (leaver.strike).
func matrixCall(t *testing.T, h *harness, path, body string, lv *leaver) matrixResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
	defer cancel()
	var done chan struct{}
	if lv != nil {
		done = lv.start(cancel)
	}
	r := func() matrixResult {
		resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, path, body, nil))
		if err != nil {
			return matrixResult{err: err}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return matrixResult{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: b, err: err}
	}()
	if done != nil {
		close(done)
		// Left: the fault cancelled the call before its answer was read whole.
		r.left = lv.left() && r.err != nil
	}
	return r
}

// check asserts what a client that stayed saw.
func (r matrixResult) check(t *testing.T, c matrixCell, want outcome, status int) {
	t.Helper()
	if want == passedOn {
		r.checkPassedOn(t)
		return
	}
	ok := r.whole(c)
	switch {
	case want == served && !ok:
		t.Fatalf("want a whole answer, got status %d (%v): %s", r.status, r.err, testutil.Clip(r.body))
	case want == served:
		return
	case want == either && ok:
		return
	case ok:
		t.Fatalf("the engine failed, yet the client got a whole answer: status %d: %s", r.status, testutil.Clip(r.body))
	}
	// A clear failure.
	if r.status != 200 {
		if r.err != nil {
			t.Fatalf("error status %d could not be read: %v", r.status, r.err)
		}
		if !strings.HasPrefix(r.ctype, "application/json") || !routeError(c, r.body) {
			t.Fatalf("status %d with %q is not an error in the route's shape: %s", r.status, r.ctype, testutil.Clip(r.body))
		}
		if status != 0 && r.status != status {
			t.Fatalf("status %d, want %d: %s", r.status, status, testutil.Clip(r.body))
		}
		return
	}
	if status != 0 && status != 200 {
		t.Fatalf("status 200, want %d before any byte: %s", status, testutil.Clip(r.body))
	}
	if !c.stream {
		if r.err == nil {
			t.Fatalf("a broken JSON answer was passed off as complete: %s", testutil.Clip(r.body))
		}
		return
	}
	// A stream that failed: its last event is an OpenAI error, and no [DONE] came.
	events := testutil.SSEDispatched(r.body)
	if len(events) == 0 {
		t.Fatalf("a failed stream with no event: %q (%v)", r.body, r.err)
	}
	if last := events[len(events)-1]; !routeError(c, []byte(last)) {
		t.Fatalf("a failed stream's last event is not an error in the route's shape: %q", last)
	}
	for _, ev := range events {
		if ev == "[DONE]" {
			t.Fatalf("a failed stream carried [DONE]: %q", r.body)
		}
	}
	if r.err != nil {
		t.Fatalf("a failed stream was cut instead of ending with its error event: %v", r.err)
	}
}

// checkPassedOn asserts that a stream carried its engine's error event to the client, after
// its tokens, with nothing but a [DONE] after it.
func (r matrixResult) checkPassedOn(t *testing.T) {
	t.Helper()
	if r.status != 200 || r.err != nil {
		t.Fatalf("status %d (%v), want the stream as its engine ended it: %s", r.status, r.err, testutil.Clip(r.body))
	}
	events := testutil.SSEDispatched(r.body)
	for i, ev := range events {
		if openAIError([]byte(ev)) {
			if rest := events[i+1:]; i == 0 || len(rest) > 1 || len(rest) == 1 && rest[0] != "[DONE]" {
				t.Fatalf("the engine's error event came at %d of %d events, want after the tokens, with at most its [DONE] after it: %s", i, len(events), testutil.Clip(r.body))
			}
			return
		}
	}
	t.Fatalf("the engine's error event did not reach the client: %s", testutil.Clip(r.body))
}

// openAIError reports whether b is an error in the OpenAI shape, as the SDKs read it: an
// "error" object with a message (vLLM's own errors carry a numeric code).
func openAIError(b []byte) bool {
	var v struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(b, &v) == nil && v.Error != nil && v.Error.Message != "" && v.Error.Type != ""
}

// whole reports whether the client got a complete, correct answer.
func (r matrixResult) whole(c matrixCell) bool {
	if r.err != nil || r.status != 200 {
		return false
	}
	if c.route == "responses" {
		return wholeResponse(r.body, c.stream)
	}
	if c.route == "messages" {
		return wholeMessage(r.body, c.stream)
	}
	if c.pass {
		var v struct {
			Data []struct {
				Embedding []float64 `json:"embedding"`
			} `json:"data"`
		}
		return json.Unmarshal(r.body, &v) == nil && len(v.Data) == 1 && len(v.Data[0].Embedding) == 3
	}
	if !c.stream {
		var v struct {
			Choices []json.RawMessage `json:"choices"`
		}
		return json.Unmarshal(r.body, &v) == nil && len(v.Choices) == 1
	}
	events := testutil.SSEDispatched(r.body)
	if len(events) != 5 || events[4] != "[DONE]" {
		return false
	}
	for _, ev := range events[:4] {
		if !json.Valid([]byte(ev)) || strings.Contains(ev, `"error"`) {
			return false
		}
	}
	return true
}

// routeError reports whether b is an error in the shape of c's route: Anthropic's on the
// Messages route ({"type":"error","error":{"type","message"}}), OpenAI's on the others.
func routeError(c matrixCell, b []byte) bool {
	if c.route != "messages" {
		return openAIError(b)
	}
	var v struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	return json.Unmarshal(b, &v) == nil && v.Type == "error" && v.Error.Type != "" && v.Error.Message != ""
}

// wholeMessage reports whether body is a whole Messages answer, as the fault engine makes it
// or as the proxy translates the engine's chat answer (SGLang): a message, or its stream from
// message_start through the four tokens' text deltas to message_stop.
func wholeMessage(body []byte, stream bool) bool {
	type event struct {
		Type    string `json:"type"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
		Delta struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"delta"`
	}
	if !stream {
		var v event
		return json.Unmarshal(body, &v) == nil && v.Type == "message" && len(v.Content) == 1 && v.Content[0].Text != ""
	}
	events := testutil.SSEDispatched(body)
	if len(events) < 3 {
		return false
	}
	var text strings.Builder
	for i, ev := range events {
		var v event
		if json.Unmarshal([]byte(ev), &v) != nil || v.Type == "error" {
			return false
		}
		if i == 0 && v.Type != "message_start" || i == len(events)-1 && v.Type != "message_stop" {
			return false
		}
		if v.Delta.Type == "text_delta" {
			text.WriteString(v.Delta.Text)
		}
	}
	return text.String() == "t0t1t2t3"
}

// wholeResponse reports whether body is the fault engine's whole Responses answer: a
// response object, or its stream from response.created through 4 deltas to response.completed.
func wholeResponse(body []byte, stream bool) bool {
	type event struct {
		Type   string `json:"type"`
		Object string `json:"object"`
		Status string `json:"status"`
	}
	if !stream {
		var v event
		return json.Unmarshal(body, &v) == nil && v.Object == "response" && v.Status == "completed"
	}
	events := testutil.SSEDispatched(body)
	if len(events) != 6 {
		return false
	}
	for i, ev := range events {
		var v event
		if json.Unmarshal([]byte(ev), &v) != nil || strings.Contains(ev, `"error"`) {
			return false
		}
		want := "response.output_text.delta"
		switch i {
		case 0:
			want = "response.created"
		case 5:
			want = "response.completed"
		}
		if v.Type != want {
			return false
		}
	}
	return true
}

// holdKey is what names, in a request to a decoder, the KV hold it is sent to pull, and
// whether the request is a drain (one token, its output discarded), "" when it names none:
// nixl's kv_transfer_params name the prefill (remote_request_id), Mooncake's the transfer
// (transfer_id), and SGLang's legs the bootstrap room.
func holdKey(c matrixCell, r faultengine.Request) (key string, drain bool) {
	if c.proto == faultengine.SGLang {
		if room := r.Field("bootstrap_room"); room != nil {
			key = string(room)
		}
	} else if kv := r.Field("kv_transfer_params"); kv != nil && !bytes.Equal(kv, []byte("null")) {
		var p struct {
			RequestID  string `json:"remote_request_id"`
			TransferID string `json:"transfer_id"`
		}
		json.Unmarshal(kv, &p)
		key = p.RequestID
		if c.proto == faultengine.Mooncake {
			key = p.TransferID
		}
	}
	one := []byte("1")
	var sp struct {
		MaxTokens json.RawMessage `json:"max_tokens"`
	}
	json.Unmarshal(r.Field("sampling_params"), &sp)
	drain = bytes.Equal(r.Field("max_tokens"), one) || bytes.Equal(r.Field("max_output_tokens"), one) || bytes.Equal(sp.MaxTokens, one)
	return key, drain
}

// paramsAtOneDecoder checks that no hold's params reached two decoders, and that none reached
// its decoder twice to be pulled: with nixl every request that carries them is a pull, so
// they go out once; with paired legs (SGLang, Mooncake) a leg cut before its transfer may be
// followed by one drain on the same decoder, which pulls what the cut leg did not.
func paramsAtOneDecoder(t *testing.T, c matrixCell, ds ...*faultengine.Engine) {
	t.Helper()
	type seen struct {
		at           map[*faultengine.Engine]bool
		legs, drains int
	}
	holds := map[string]*seen{}
	for _, d := range ds {
		for _, r := range d.Requests() {
			key, drain := holdKey(c, r)
			if key == "" {
				continue
			}
			s := holds[key]
			if s == nil {
				s = &seen{at: map[*faultengine.Engine]bool{}}
				holds[key] = s
			}
			s.at[d] = true
			if drain {
				s.drains++
			} else {
				s.legs++
			}
		}
	}
	for key, s := range holds {
		switch {
		case len(s.at) > 1:
			t.Errorf("the params of hold %s reached %d decoders", key, len(s.at))
		case c.proto == faultengine.VLLM && s.legs+s.drains > 1:
			t.Errorf("the params of hold %s reached a decoder %d times", key, s.legs+s.drains)
		case s.legs > 1 || s.drains > 1:
			t.Errorf("the params of hold %s reached a decoder in %d legs and %d drains", key, s.legs, s.drains)
		}
	}
}

// abortsAfterDecodes checks the explicit aborts of a sequential engine that has them (sim):
// its legs are not paired, so its decoder is never aborted, and what "decoder first" means
// there is that no decode carrying a hold's params reaches a decoder after the prefiller was
// told to free that hold. A client that left during the prefill has it aborted: the engine
// may have finished it as the connection closed, and would hold KV nobody pulls.
func abortsAfterDecodes(t *testing.T, c matrixCell, p *faultengine.Engine, ds ...*faultengine.Engine) {
	t.Helper()
	aborted := func() map[string]time.Time {
		m := map[string]time.Time{}
		for _, r := range p.Requests() {
			var a struct {
				RID string `json:"rid"`
			}
			if r.Path != "/abort_request" || json.Unmarshal(r.Body, &a) != nil {
				continue
			}
			if _, ok := m[a.RID]; !ok {
				m[a.RID] = r.At
			}
		}
		return m
	}
	if c.leave && c.leg == "prefill" {
		eventually(t, "the prefill aborted", func() bool { return len(aborted()) > 0 })
	}
	abortAt := aborted()
	for _, d := range ds {
		for _, r := range d.Requests() {
			if r.Path == "/abort_request" {
				t.Errorf("a decoder of a sequential engine was sent an abort")
			}
			key, _ := holdKey(c, r)
			if at, ok := abortAt[key]; ok && key != "" && r.At.After(at) {
				t.Errorf("the params of hold %s reached a decoder %v after the prefiller was told to free it", key, r.At.Sub(at))
			}
		}
	}
}

// legsAbortedDecoderFirst checks SGLang's aborts: a request that failed with its decoder's
// leg at fault has that leg aborted, and when both legs are aborted, the decoder's goes first.
func legsAbortedDecoderFirst(t *testing.T, c matrixCell, p, d *faultengine.Engine, got matrixResult) {
	t.Helper()
	firstAbort := func(e *faultengine.Engine) (time.Time, bool) {
		for _, r := range e.Requests() {
			if r.Path == "/abort_request" {
				return r.At, true
			}
		}
		return time.Time{}, false
	}
	want, _ := c.expected()
	mustAbortDecoder := !c.leave && c.leg == "decode" && want == failed && c.fault != faultengine.KeepAliveReset
	if mustAbortDecoder {
		eventually(t, "the decoder's leg aborted", func() bool { _, ok := firstAbort(d); return ok })
	}
	dAt, dOK := firstAbort(d)
	pAt, pOK := firstAbort(p)
	if pOK && !dOK {
		t.Errorf("the prefiller's leg was aborted and the decoder's was not")
	}
	if pOK && dOK && pAt.Before(dAt) {
		t.Errorf("the prefiller's leg was aborted %v before the decoder's", dAt.Sub(pAt))
	}
}
