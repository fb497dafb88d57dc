package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// chaosParams sizes TestChaos: the tiny run (every `go test`) kills a decoder a few times
// under a handful of streams; PDPROXY_BENCH_CHAOS=full is the measurement.
type chaosParams struct {
	name       string
	prefillers int
	decoders   int
	clients    int // streams open at once, each client opening the next when one ends
	// Each stream asks for max_tokens in [minTokens, maxTokens], and every other one is a chat
	// completion (the rest completions).
	minTokens, maxTokens int
	itl                  time.Duration // the simulated engines' inter-token latency
	duration             time.Duration // how long the clients open streams
	killEvery            time.Duration // a live decoder is killed this often...
	downFor              time.Duration // ...and restarted this much later
	contenders           []chaosContender
	// protocols are the engine protocols each contender runs on (sim.ProtocolVLLM, ...).
	protocols []string
}

// chaosContender is one proxy configuration the chaos is run against.
type chaosContender struct {
	name      string
	migration int  // migration_limit
	noEject   bool // passive ejection off (consecutive_failures: -1)
	// whole says whether every stream must reach its client whole: what migration promises
	// within its limit. wholeOrLimit asks only that a stream not whole be one that reached it.
	whole, wholeOrLimit bool
}

func chaosParamsOf(t *testing.T) chaosParams {
	p := chaosParams{name: "tiny", prefillers: 1, decoders: 2, clients: 6, minTokens: 16, maxTokens: 40, itl: 10 * time.Millisecond,
		duration: 3 * time.Second, killEvery: time.Second, downFor: 300 * time.Millisecond,
		contenders: []chaosContender{{name: "migration_limit 3", migration: 3, whole: true}}}
	// Every protocol in CI's run; one, vLLM's unless PDPROXY_BENCH_CHAOS_PROTOCOL names
	// another, in a measurement.
	protocols := []string{sim.ProtocolVLLM, sim.ProtocolSGLang, sim.ProtocolMooncake}
	if proto := os.Getenv("PDPROXY_BENCH_CHAOS_PROTOCOL"); proto != "" {
		protocols = []string{proto}
	} else if os.Getenv("PDPROXY_BENCH_CHAOS") != "" {
		protocols = protocols[:1]
	}
	switch os.Getenv("PDPROXY_BENCH_CHAOS") {
	case "full":
		p = chaosParams{name: "full", prefillers: 2, decoders: 3, clients: 200, minTokens: 200, maxTokens: 2000, itl: 20 * time.Millisecond,
			duration: 60 * time.Second, killEvery: 5 * time.Second, downFor: time.Second,
			// A 2,000-token stream lasts 40 s and more, through 8 kills or more, each of its
			// decoder one time in three: a quarter of those are hit more than 3 times.
			contenders: []chaosContender{
				{name: "migration_limit 3", migration: 3, wholeOrLimit: true},
				{name: "migration_limit 10", migration: 10, whole: true},
				{name: "migration_limit 0", migration: 0},
			}}
	case "storm":
		// Kills faster than ejections end: both decoders are often out at once, and holds
		// wait for a decoder to drain through. Streams are refused then: only what is left
		// held is asserted.
		p = chaosParams{name: "storm", prefillers: 1, decoders: 2, clients: 6, minTokens: 16, maxTokens: 40, itl: 10 * time.Millisecond,
			duration: 4 * time.Second, killEvery: 150 * time.Millisecond, downFor: 50 * time.Millisecond,
			contenders: []chaosContender{{name: "migration_limit 3", migration: 3}}}
	case "short":
		p = chaosParams{name: "short", prefillers: 1, decoders: 3, clients: 24, minTokens: 48, maxTokens: 48, itl: 20 * time.Millisecond,
			duration: 60 * time.Second, killEvery: 2 * time.Second, downFor: time.Second,
			contenders: []chaosContender{
				{name: "migration_limit 3", migration: 3, whole: true},
				{name: "migration_limit 3, ejection off", migration: 3, noEject: true, whole: true},
				{name: "migration_limit 0", migration: 0},
			}}
	}
	p.protocols = protocols
	return p
}

// TestChaos is a rolling crash of the decoders under streams: p.prefillers prefillers and
// p.decoders decoders of the sim, each an HTTP server of its own on loopback, behind the proxy
// on P/D; p.clients clients open greedy streams back to back (16 prompts, every other stream a
// chat completion, the rest completions, each of p.minTokens to p.maxTokens tokens, temperature
// 0, so an unbroken answer is known); every p.killEvery a live decoder is killed as SIGKILL
// kills (every connection closed at once, the listener gone, its KV lost) and restarted
// p.downFor later, empty. For each contender it reports the streams that reached their client
// whole (every token, [DONE], the text of an unbroken answer), those that failed by how (cut,
// refused, wrong text), those a kill hit mid-answer (the proxy's request log counts their
// migrations, or their client got a part of the answer), what the proxy migrated and refused,
// the largest gap within each stream (hit and not), and the KV the prefillers still hold once
// the streams are over.
//
// CI's run goes through each engine protocol in turn (vLLM's NIXL, SGLang, vLLM's Mooncake);
// a measurement through one, vLLM's unless PDPROXY_BENCH_CHAOS_PROTOCOL names another.
//
// It asserts what a user would notice: with migration on every stream is whole (an SGLang
// stream does not move: one a kill hits fails); no stream that ends whole in form has another
// answer's text; under any contender nothing is left held on the prefillers, in the proxy's
// table or on its leases.
// PDPROXY_BENCH_CHAOS=full is the measurement (2 prefillers, 3 decoders, 200 clients, streams
// of 200 to 2,000 tokens at a 20 ms ITL for 60 s, a kill every 5 s, with and without
// migration); =short the earlier, lighter one (1 prefiller, 24 clients, 48 tokens, a kill every
// 2 s); =storm a kill every 150 ms, down 50 ms, of one of 2 decoders, for 4 s, which asserts
// only that nothing is left held; PDPROXY_BENCH_CHAOS_OUT=FILE also writes the table to FILE.
func TestChaos(t *testing.T) {
	p := chaosParamsOf(t)
	var rows []string
	for _, proto := range p.protocols {
		for _, c := range p.contenders {
			if proto != sim.ProtocolVLLM {
				c.name = proto + ", " + c.name
			}
			r := runChaos(t, p, proto, c)
			rows = append(rows, r.row(c.name))
			// SGLang's streams do not move: one a kill hits fails, whatever the limit.
			moves := proto != sim.ProtocolSGLang
			if moves && c.whole && r.whole != r.streams {
				t.Errorf("%s: %d of %d streams reached their client whole (cut %d, refused %d, wrong text %d); migration promises all",
					c.name, r.whole, r.streams, r.cut, r.refused, r.wrong)
			}
			if moves && c.wholeOrLimit && (r.refused != 0 || r.wrong != 0 || r.cut != r.exceeded) {
				t.Errorf("%s: %d of %d streams reached their client whole (cut %d, refused %d, wrong text %d), %d at the migration limit; "+
					"migration promises every stream not at its limit", c.name, r.whole, r.streams, r.cut, r.refused, r.wrong, r.exceeded)
			}
			if r.wrong != 0 {
				t.Errorf("%s: %d streams ended with every token and [DONE], yet not the unbroken answer's text", c.name, r.wrong)
			}
		}
	}
	table := fmt.Sprintf("chaos (%s: %d prefillers, %d decoders, %d clients, %d-%d tokens at %v, completions and chat, %v, a kill every %v, down %v)\n\n",
		p.name, p.prefillers, p.decoders, p.clients, p.minTokens, p.maxTokens, p.itl, p.duration, p.killEvery, p.downFor) +
		"| contender | streams | whole | failed: cut / refused / wrong text | hit by a kill | hit, whole | migrated | not migratable | limit reached | tokens replayed | largest gap p50 / p99, hit | not hit | KV left |\n" +
		"|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + strings.Join(rows, "\n") + "\n"
	t.Log("\n" + table)
	if out := os.Getenv("PDPROXY_BENCH_CHAOS_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// chaosRun is what one contender did.
type chaosRun struct {
	streams, whole, cut, refused, wrong int
	hit, hitWhole                       int
	moved, moveRefused, exceeded        int
	replayed                            int
	gapHit, gapOther                    []time.Duration // each stream's largest gap, sorted
	kvLeft                              int
}

func (r chaosRun) row(name string) string {
	gaps := func(g []time.Duration) string {
		if len(g) == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f / %.0f ms", msf(q(g, 0.5)), msf(q(g, 0.99)))
	}
	return fmt.Sprintf("| %s | %d | %d | %d / %d / %d | %d | %d | %d | %d | %d | %d | %s | %s | %d |", name, r.streams, r.whole,
		r.cut, r.refused, r.wrong, r.hit, r.hitWhole, r.moved, r.moveRefused, r.exceeded, r.replayed, gaps(r.gapHit), gaps(r.gapOther), r.kvLeft)
}

// chaosStream is what a client saw of one stream.
type chaosStream struct {
	id string
	chaosAsk
	status int
	pieces []string // each token's text, as its event brought it
	done   bool
	at     []time.Time // each text event's arrival
	err    error
}

// chaosAsk is what a stream asks for: which prompt, as a chat or a completion, how many tokens.
type chaosAsk struct {
	prompt int
	chat   bool
	tokens int
}

func runChaos(t *testing.T, p chaosParams, proto string, c chaosContender) chaosRun {
	cfg := sim.DefaultConfig()
	cfg.ITL, cfg.PrefillTime = p.itl, 10*time.Millisecond
	// Room for every stream's prompt and answer on the decoders left up while one is down.
	cfg.KVBlocks = max(cfg.KVBlocks, 2*p.clients*(p.maxTokens/16+32)/max(p.decoders-1, 1))
	logger := zap.NewNop()
	listen := func(cfg sim.Config) *sim.Server {
		s, err := sim.Listen(cfg, "127.0.0.1:0", logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	var prefillers, decoders []*sim.Server
	pc := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	pc.Proxy.MigrationLimit = c.migration
	pc.Router.Health = routerconfig.HealthConfig{Interval: 200 * time.Millisecond}
	if c.noEject {
		pc.Router.Ejection.ConsecutiveFailures = -1
	}
	kind := map[string]string{sim.ProtocolVLLM: engine.KindVLLM, sim.ProtocolSGLang: engine.KindSGLang, sim.ProtocolMooncake: engine.KindMooncake}[proto]
	if kind == "" {
		t.Fatalf("PDPROXY_BENCH_CHAOS_PROTOCOL=%q: want %s, %s or %s", proto, sim.ProtocolVLLM, sim.ProtocolSGLang, sim.ProtocolMooncake)
	}
	pcfg, dcfg := cfg, cfg
	pcfg.Protocol, pcfg.Role = proto, "prefill"
	dcfg.Protocol, dcfg.Role = proto, "decode"
	pcfg.BootstrapPort, dcfg.BootstrapPort = 0, 0 // a free port, read back below
	for i := range p.prefillers {
		pf := listen(pcfg)
		prefillers = append(prefillers, pf)
		pc.Router.Backends = append(pc.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("p%d", i), URL: pf.URL(), Role: routerconfig.RolePrefill, Engine: kind,
			BootstrapPort: pf.Engine().BootstrapPort()})
	}
	for i := range p.decoders {
		d := listen(dcfg)
		decoders = append(decoders, d)
		pc.Router.Backends = append(pc.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: d.URL(), Role: routerconfig.RoleDecode, Engine: kind})
	}
	core, logs := observer.New(zap.InfoLevel)
	m := startMainLogged(t, pc, zap.New(core))
	prompts := make([]string, 16)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("chaos prompt %d: %s", i, strings.Repeat(fmt.Sprintf("word%d ", i), 40))
	}
	body := func(a chaosAsk) string {
		b := map[string]any{"model": "sim", "max_tokens": a.tokens, "ignore_eos": true, "temperature": 0, "stream": true}
		if a.chat {
			b["messages"] = []map[string]string{{"role": "user", "content": prompts[a.prompt]}}
		} else {
			b["prompt"] = prompts[a.prompt]
		}
		out, _ := json.Marshal(b)
		return string(out)
	}

	client := newClient(p.clients * 2)
	client.Timeout = p.duration + time.Duration(p.maxTokens)*p.itl*3
	defer client.CloseIdleConnections()
	ctx, stop := context.WithTimeout(context.Background(), p.duration)
	defer stop()
	var (
		mu      sync.Mutex
		streams []*chaosStream
		ids     atomic.Int64
		wg      sync.WaitGroup
	)
	for w := range p.clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for ctx.Err() == nil {
				n := ids.Add(1)
				a := chaosAsk{prompt: rng.IntN(len(prompts)), chat: n%2 == 0, tokens: p.minTokens + rng.IntN(p.maxTokens-p.minTokens+1)}
				s := chaosRead(client, m.URL(), fmt.Sprintf("chaos-%d", n), a, body)
				mu.Lock()
				streams = append(streams, s)
				mu.Unlock()
			}
		})
	}
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(1, 2))
		tick := time.NewTicker(p.killEvery)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			d := decoders[rng.IntN(len(decoders))]
			d.Kill()
			select {
			case <-ctx.Done():
			case <-time.After(p.downFor):
			}
			if err := d.Restart(); err != nil {
				t.Errorf("restart %s: %v", d.Addr(), err)
				return
			}
		}
	})
	wg.Wait()

	// The unbroken answers, of every prompt at the longest length in both APIs, from an engine
	// of its own that never dies (greedy tokens follow from the prefix alone, whatever the
	// ITL); a shorter stream's answer is their first tokens.
	refCfg := cfg
	refCfg.ITL = 0
	ref := listen(refCfg)
	want := map[chaosAsk][]string{}
	for i := range prompts {
		for _, chat := range []bool{false, true} {
			a := chaosAsk{prompt: i, chat: chat, tokens: p.maxTokens}
			s := chaosRead(client, ref.URL(), "", a, body)
			if s.err != nil || !s.done || len(s.pieces) != p.maxTokens {
				t.Fatalf("the unbroken answer to %+v: %v, %d tokens, done %v", a, s.err, len(s.pieces), s.done)
			}
			a.tokens = 0
			want[a] = s.pieces
		}
	}
	wantText := func(a chaosAsk) string {
		a, n := chaosAsk{prompt: a.prompt, chat: a.chat}, a.tokens
		return strings.Join(want[a][:n], "")
	}
	// A stream a kill hit is one the proxy moved: its request's log line counts migrations.
	moved := map[string]bool{}
	for _, e := range logs.FilterMessage("request").All() {
		if n, ok := e.ContextMap()["migrations"].(int64); ok && n > 0 {
			moved[e.ContextMap()["request_id"].(string)] = true
		}
	}
	run := chaosRun{streams: len(streams)}
	for _, s := range streams {
		whole := s.err == nil && s.status == http.StatusOK && s.done && len(s.pieces) == s.tokens && strings.Join(s.pieces, "") == wantText(s.chaosAsk)
		switch {
		case whole:
			run.whole++
		case s.status != 0 && s.status != http.StatusOK:
			run.refused++
			if run.refused <= 3 {
				t.Logf("%s: %s: %v", c.name, s.id, s.err)
			}
		case s.done && len(s.pieces) == s.tokens:
			run.wrong++
		default:
			run.cut++
		}
		largest := time.Duration(0)
		for i := 1; i < len(s.at); i++ {
			largest = max(largest, s.at[i].Sub(s.at[i-1]))
		}
		switch {
		case moved[s.id] || !whole && len(s.at) > 0:
			// Moved, or cut after its first token: a kill hit it mid-answer.
			run.hit++
			if whole {
				run.hitWhole++
			}
			run.gapHit = append(run.gapHit, largest)
		case len(s.at) > 1:
			run.gapOther = append(run.gapOther, largest)
		}
	}
	slices.Sort(run.gapHit)
	slices.Sort(run.gapOther)
	run.moved = counterOf(t, m.Registry, "pdproxy_migrations_total", "outcome", "migrated")
	run.moveRefused = counterOf(t, m.Registry, "pdproxy_migrations_total", "outcome", "not_migratable")
	run.exceeded = counterOf(t, m.Registry, "pdproxy_migrations_total", "outcome", "limit_reached")
	run.replayed = counterOf(t, m.Registry, "pdproxy_migration_tokens_replayed_total", "", "")

	// Nothing left held: every hold released by the proxy at once (the prefiller's own lease
	// would take 30 s), the table empty, no lease in flight.
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		held, running := 0, 0
		for _, pf := range prefillers {
			st := pf.Engine().Stats()
			held += st.BlocksHeld
			running += st.RunningRequests
		}
		inflight := 0
		for _, b := range m.Router.Backends() {
			inflight += int(b.Inflight)
		}
		run.kvLeft = held
		return held == 0 && running == 0 && m.Table.Len() == 0 && inflight == 0,
			fmt.Sprintf("%s: after the last stream the prefillers hold %d blocks for %d requests, the proxy tracks %d and counts %d in flight",
				c.name, held, running, m.Table.Len(), inflight)
	})
	for _, pf := range prefillers {
		checkEngine(t, "prefiller", pf.Engine().Stats())
	}
	return run
}

// chaosRead streams prompt i's body from url and records what its client saw.
func chaosRead(client *http.Client, url, id string, a chaosAsk, body func(chaosAsk) string) *chaosStream {
	s := &chaosStream{id: id, chaosAsk: a}
	path := "/v1/completions"
	if a.chat {
		path = "/v1/chat/completions"
	}
	req, err := http.NewRequest(http.MethodPost, url+path, strings.NewReader(body(a)))
	if err != nil {
		s.err = err
		return s
	}
	req.Header.Set("Content-Type", "application/json")
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	resp, err := client.Do(req)
	if err != nil {
		s.err = err
		return s
	}
	defer resp.Body.Close()
	s.status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		s.err = fmt.Errorf("%d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		return s
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		payload, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok {
			continue
		}
		if string(payload) == "[DONE]" {
			s.done = true
			continue
		}
		var ev struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(payload, &ev); err != nil || ev.Error != nil {
			s.err = fmt.Errorf("event %s", payload)
			continue
		}
		for _, c := range ev.Choices {
			if text := c.Text + c.Delta.Content; text != "" { // not a chat's role or finish chunk
				s.pieces = append(s.pieces, text)
				s.at = append(s.at, time.Now())
			}
		}
	}
	if err := sc.Err(); err != nil && s.err == nil {
		s.err = err
	}
	return s
}

// counterOf sums the counter name's series whose label has value (every series when label
// is empty).
func counterOf(t *testing.T, reg *prometheus.Registry, name, label, value string) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := label == ""
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					match = true
				}
			}
			if match {
				n += int(m.GetCounter().GetValue())
			}
		}
	}
	return n
}
