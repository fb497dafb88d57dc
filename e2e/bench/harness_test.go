package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// params sizes a harness run. The tiny one runs with every `go test` (under -race in CI) and
// only shows that each scenario runs and yields numbers; PDPROXY_BENCH=full runs the real one.
type params struct {
	name        string
	concurrency uint64        // workers of a max-throughput attack
	rounds      int           // max-throughput rounds, direct and proxy alternating
	roundDur    time.Duration // one max-throughput attack
	rate        int           // requests per second of the fixed-rate attacks
	rateDur     time.Duration // one fixed-rate attack
	probes      int           // abort probes per stage and path
	probeGap    time.Duration // pause between two probes
	streams     int           // concurrent slow streams of the scale scenario
	interval    time.Duration // between two chunks of a slow stream
	hold        time.Duration // how long the scale scenario keeps every stream open
	openBudget  time.Duration // the longest the scale scenario may take to open its streams
	healthEvery time.Duration // between two /health calls during the scale scenario
	streamsCap  string        // why streams is less than asked for, if it is
}

func harnessParams(t *testing.T) params {
	p := params{
		name: "tiny", concurrency: 8, rounds: 1, roundDur: 200 * time.Millisecond,
		rate: 100, rateDur: 300 * time.Millisecond, probes: 3, probeGap: 5 * time.Millisecond,
		streams: 20, interval: 50 * time.Millisecond, hold: 100 * time.Millisecond,
		openBudget: time.Minute, healthEvery: 10 * time.Millisecond,
	}
	if os.Getenv("PDPROXY_BENCH") == "full" {
		p = params{
			name: "full", concurrency: 64, rounds: 10, roundDur: time.Second,
			rate: 500, rateDur: 10 * time.Second, probes: 200, probeGap: 10 * time.Millisecond,
			streams: 10000, interval: time.Second, hold: 10 * time.Second,
			openBudget: 3 * time.Minute, healthEvery: 10 * time.Millisecond,
		}
	}
	for env, dst := range map[string]*int{"PDPROXY_BENCH_STREAMS": &p.streams, "PDPROXY_BENCH_ROUNDS": &p.rounds, "PDPROXY_BENCH_RATE": &p.rate, "PDPROXY_BENCH_PROBES": &p.probes} {
		if v := os.Getenv(env); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("%s=%q: want a positive integer", env, v)
			}
			*dst = n
		}
	}
	if v := os.Getenv("PDPROXY_BENCH_CONCURRENCY"); v != "" {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil || n == 0 {
			t.Fatalf("PDPROXY_BENCH_CONCURRENCY=%q: want a positive integer", v)
		}
		p.concurrency = n
	}
	return p
}

// fdSlack is the descriptors a process of the harness needs besides its slow streams.
const fdSlack = 512

// harness is one run: the fast backends, the proxies in front of them and the report.
type harness struct {
	t          *testing.T
	p          params
	prefill    *backend
	decode     *backend
	body       []byte
	profileDir string
	rep        *report
	// proxies by mode ("aggregated", "pd"): the proxy on its default engine client, and the
	// same on engine_client stdlib (Go's net/http client), so that both are measured in one run.
	proxy, stdlib map[string]*proxyProc
	// nginx is in front of the decoder, for the aggregated figures; nil when not installed.
	nginx *nginxProc
}

// TestHarness measures the proxy against direct calls to the same backend, scenario by
// scenario, and prints the figures. PDPROXY_BENCH=full is the real run (a few minutes);
// PDPROXY_BENCH_ONLY=throughput,long,latency,abort,scale picks scenarios;
// PDPROXY_BENCH_PROFILE=DIR saves the proxy's CPU and allocation profiles at max throughput
// there, its CPU profile at the fixed rate, and its heap and goroutine profiles with every
// slow stream open; PDPROXY_BENCH_OUT=FILE also writes the report to FILE;
// PDPROXY_BENCH_PROXY_ENV="GOGC=400 ..." sets environment variables for the proxy processes
// alone; PDPROXY_BENCH_ENGINE_CLIENT=stdlib|lean picks the proxy's engine client (default: the
// router's), and a second proxy on engine_client stdlib runs beside it in throughput, long and
// latency unless PDPROXY_BENCH_STDLIB=0. nginx, when installed (PDPROXY_BENCH_NGINX names
// another binary), runs in front of the decoder as the reference of the aggregated figures;
// without it the report says so and the rest runs. Nothing here asserts a speed: only that
// every request streamed to its end, that every abort reached the backend, and that each
// scenario produced its figures.
func TestHarness(t *testing.T) {
	p := harnessParams(t)
	// A slow stream costs the proxy two descriptors (client and backend connection) and this
	// process two as well (the client's and the backend's end). Where the hard limit cannot
	// be raised (a container without CAP_SYS_RESOURCE), fewer streams are opened; the report
	// says how many.
	if limit, err := raiseNoFile(uint64(2*p.streams + fdSlack)); err != nil {
		p.streams = min(p.streams, (int(limit)-fdSlack)/2)
		p.streamsCap = fmt.Sprintf(" (capped: RLIMIT_NOFILE %d cannot be raised here)", limit)
		t.Logf("%v: the scale scenario opens %d streams", err, p.streams)
	}
	h := &harness{
		t: t, p: p, prefill: startBackend(t), decode: startBackend(t), body: streamBody(1),
		profileDir: os.Getenv("PDPROXY_BENCH_PROFILE"), rep: &report{params: p},
		proxy: map[string]*proxyProc{}, stdlib: map[string]*proxyProc{},
	}
	only := os.Getenv("PDPROXY_BENCH_ONLY")
	selected := func(name string) bool {
		return only == "" || slices.Contains(strings.Split(only, ","), name)
	}
	run := func(name string, f func(*testing.T)) {
		if selected(name) {
			t.Run(name, f)
		}
	}
	if selected("throughput") || selected("long") || selected("latency") || selected("abort") {
		ec := os.Getenv("PDPROXY_BENCH_ENGINE_CLIENT")
		h.proxy["aggregated"] = startProxy(t, childConfig{Decode: []string{h.decode.URL()}, EngineClient: ec})
		h.proxy["pd"] = startProxy(t, childConfig{Prefill: []string{h.prefill.URL()}, Decode: []string{h.decode.URL()}, EngineClient: ec})
	}
	if (selected("throughput") || selected("long") || selected("latency")) && os.Getenv("PDPROXY_BENCH_STDLIB") != "0" {
		h.stdlib["aggregated"] = startProxy(t, childConfig{Decode: []string{h.decode.URL()}, EngineClient: routerconfig.EngineClientStdlib})
		h.stdlib["pd"] = startProxy(t, childConfig{Prefill: []string{h.prefill.URL()}, Decode: []string{h.decode.URL()}, EngineClient: routerconfig.EngineClientStdlib})
	}
	if selected("throughput") || selected("long") || selected("latency") {
		var note string
		h.nginx, note = startNginx(t, strings.TrimPrefix(h.decode.URL(), "http://"))
		if note != "" {
			t.Log(note)
			h.rep.add(row{"nginx", "", "", note, "", ""})
		}
	}
	run("throughput", func(t *testing.T) {
		h.throughput(t, "aggregated", chunksPerStream)
		h.throughput(t, "pd", chunksPerStream)
	})
	run("long", func(t *testing.T) { h.throughput(t, "aggregated", longStream) })
	run("latency", func(t *testing.T) {
		h.latency(t, "aggregated")
		h.latency(t, "pd")
	})
	run("abort", func(t *testing.T) { h.abort(t, h.proxy["pd"]) })
	run("scale", h.scale)
	h.rep.write(t)
}

// longStream is the chunks of a long stream (figure 7).
const longStream = 256

// contender is a path to the decoder that is measured against the direct one: the proxy, the
// proxy on engine_client stdlib, nginx.
type contender struct {
	name string
	url  string
	cpu  func() (float64, error) // its process's CPU seconds so far
}

// contenders of a mode, the proxy first.
func (h *harness) contenders(mode string) []contender {
	var cs []contender
	for _, pc := range []struct {
		name string
		proc *proxyProc
	}{{"proxy", h.proxy[mode]}, {"proxy (engine_client stdlib)", h.stdlib[mode]}} {
		if pc.proc == nil {
			continue
		}
		proc := pc.proc
		cs = append(cs, contender{pc.name, proc.url, func() (float64, error) {
			s, err := proc.sample()
			return s.cpuSeconds, err
		}})
	}
	if mode == "aggregated" && h.nginx != nil {
		cs = append(cs, contender{"nginx", h.nginx.url, h.nginx.cpuSeconds})
	}
	return cs
}

// targets of one mode: the direct call(s) and the contenders.
type modeTargets struct {
	direct     attackSpec // aggregated: the backend; pd: the decoder alone (decode-only)
	directPair attackSpec // pd only: the prefill then the decode, made by the client
	via        []attackSpec
}

func (h *harness) targets(mode string, cs []contender, conns int, header http.Header) (modeTargets, func()) {
	var mt modeTargets
	dc := newClient(conns)
	mt.direct = attackSpec{client: dc, url: h.decode.URL() + "/v1/completions", body: h.body, header: header}
	closers := []func(){dc.CloseIdleConnections}
	for _, c := range cs {
		cc := newClient(conns)
		mt.via = append(mt.via, attackSpec{client: cc, url: c.url + "/v1/completions", body: h.body, header: header})
		closers = append(closers, cc.CloseIdleConnections)
	}
	if mode == "pd" {
		base := newClient(conns)
		pair, err := newPDDirect(base.Transport, h.prefill.URL(), h.body)
		if err != nil {
			h.t.Fatal(err)
		}
		pairClient := &http.Client{Timeout: time.Minute, Transport: pair}
		mt.directPair = attackSpec{client: pairClient, url: h.decode.URL() + "/v1/completions", body: h.body, header: header}
		closers = append(closers, pairClient.CloseIdleConnections)
	}
	return mt, func() {
		for _, c := range closers {
			c()
		}
	}
}

// checkStreams fails the test when an attack lost requests: a proxy that truncates or drops
// streams is broken whatever its speed.
func checkStreams(t *testing.T, what string, r loadResult) {
	t.Helper()
	if r.ok == 0 || r.failed > 0 {
		t.Errorf("%s: %d streams complete, %d failed (first: %s)", what, r.ok, r.failed, r.firstErr)
	}
}

// throughput is figures 1 and 2 (and the CPU of figure 6), or with chunks = longStream figure
// 7: closed-loop attacks with a fixed number of workers, the direct path and every contender
// once a round, the order rotating round by round so that drift on a shared machine falls on
// all of them.
func (h *harness) throughput(t *testing.T, mode string, chunks int) {
	p := h.p
	cs := h.contenders(mode)
	var header http.Header
	if chunks != chunksPerStream {
		header = http.Header{hdrChunks: {strconv.Itoa(chunks)}}
	}
	var direct, pair []float64
	rates := make([][]float64, len(cs))
	cpu := make([]float64, len(cs))
	oks := make([]int, len(cs))
	if h.profileDir != "" && chunks == chunksPerStream {
		h.profile(t, mode, cs[0])
	}
	for round := 0; round < p.rounds; round++ {
		mt, closeAll := h.targets(mode, cs, int(p.concurrency), header)
		for _, s := range append([]*attackSpec{&mt.direct, &mt.directPair}, pointers(mt.via)...) {
			s.workers, s.dur = p.concurrency, p.roundDur
		}
		steps := []func(){func() {
			r := attack(mt.direct)
			checkStreams(t, mode+" direct", r)
			direct = append(direct, r.rate())
			if mode == "pd" {
				r := attack(mt.directPair)
				checkStreams(t, mode+" direct pair", r)
				pair = append(pair, r.rate())
			}
		}}
		for i := range cs {
			steps = append(steps, func() {
				before, err := cs[i].cpu()
				if err != nil {
					t.Fatal(err)
				}
				r := attack(mt.via[i])
				after, err := cs[i].cpu()
				if err != nil {
					t.Fatal(err)
				}
				checkStreams(t, mode+" via "+cs[i].name, r)
				rates[i] = append(rates[i], r.rate())
				cpu[i] += after - before
				oks[i] += r.ok
			})
		}
		for j := range steps {
			steps[(j+round)%len(steps)]()
		}
		closeAll()
	}
	// A ratio is the median of the rounds' own ratios: a burst of load from elsewhere on a
	// shared machine then spoils a round, not the figure.
	d := median(direct)
	for i, c := range cs {
		x, ratio := median(rates[i]), median(quotients(rates[i], direct))
		var fig, target, met string
		switch {
		case chunks != chunksPerStream:
			fig = fmt.Sprintf("7. aggregated %d-chunk streams, max throughput (req/s), via %s", chunks, c.name)
		case mode == "pd":
			fig = "2. P/D streaming, max throughput (req/s), via " + c.name
		default:
			fig = "1. aggregated streaming, max throughput (req/s), via " + c.name
		}
		if i == 0 && chunks == chunksPerStream {
			target, met = "proxy/direct >= 0.65", h.rep.met(ratio >= 0.65)
			if mode == "pd" {
				target, met = "proxy/direct decode-only >= 0.45", h.rep.met(ratio >= 0.45)
			}
		}
		h.rep.add(row{fig, fmt.Sprintf("%.0f", d), fmt.Sprintf("%.0f", x), fmt.Sprintf("ratio %.2f (rounds %s)", ratio, spread(quotients(rates[i], direct))), target, met})
		if mode == "pd" && i == 0 {
			h.rep.add(row{"2b. P/D, against the client making both calls itself", fmt.Sprintf("%.0f", median(pair)), fmt.Sprintf("%.0f", x),
				fmt.Sprintf("ratio %.2f (rounds %s)", median(quotients(rates[i], pair)), spread(quotients(rates[i], pair))), "(no target)", ""})
		}
		if d <= 0 || x <= 0 {
			t.Errorf("%s throughput via %s: direct %.0f, %.0f req/s: no figure", mode, c.name, d, x)
		}
	}
	if n := len(cs); n > 1 && cs[n-1].name == "nginx" {
		r := quotients(rates[0], rates[n-1])
		fig, target, met := "1. aggregated max throughput, proxy / nginx", "proxy/nginx >= 0.80", h.rep.met(median(r) >= 0.80)
		if chunks != chunksPerStream {
			fig, target, met = fmt.Sprintf("7. aggregated %d-chunk streams, proxy / nginx", chunks), "(no target)", ""
		}
		h.rep.add(row{fig, "", "", fmt.Sprintf("ratio %.2f (rounds %s)", median(r), spread(r)), target, met})
	}
	for i, c := range cs {
		if oks[i] == 0 {
			continue
		}
		busy := fmt.Sprintf("%.2f of %d cores busy", cpu[i]/(float64(p.rounds)*p.roundDur.Seconds()), runtime.NumCPU())
		if chunks != chunksPerStream {
			h.rep.add(row{fmt.Sprintf("7. CPU per 1,000 chunks relayed, %d-chunk streams at max throughput, %s", chunks, c.name), "",
				fmt.Sprintf("%.1f ms", cpu[i]/float64(oks[i]*chunks)*1e6), busy, "(no target)", ""})
			continue
		}
		h.rep.add(row{"6. CPU per 1,000 requests at max throughput, " + mode + ", " + c.name, "", fmt.Sprintf("%.3f s", cpu[i]/float64(oks[i])*1000), busy, "(no target)", ""})
	}
}

func pointers(specs []attackSpec) []*attackSpec {
	var ps []*attackSpec
	for i := range specs {
		ps = append(ps, &specs[i])
	}
	return ps
}

// profile takes the proxy's CPU profile over a max-throughput attack of its own (not counted
// in any figure), then its allocation profile, into the profile directory.
func (h *harness) profile(t *testing.T, mode string, c contender) {
	const secs = 10
	proc := h.proxy[mode]
	mt, closeAll := h.targets(mode, []contender{c}, int(h.p.concurrency), nil)
	defer closeAll()
	mt.via[0].workers, mt.via[0].dur = h.p.concurrency, (secs+1)*time.Second
	var prof sync.WaitGroup
	prof.Go(func() {
		time.Sleep(500 * time.Millisecond) // past the warm-up
		file := filepath.Join(h.profileDir, "cpu-"+mode+".pprof")
		if err := proc.profile(fmt.Sprintf("profile?seconds=%d", secs), file); err != nil {
			t.Errorf("cpu profile: %v", err)
		}
	})
	checkStreams(t, mode+" via proxy, profiled", attack(mt.via[0]))
	prof.Wait()
	if err := proc.profile("allocs", filepath.Join(h.profileDir, "allocs-"+mode+".pprof")); err != nil {
		t.Errorf("allocs profile: %v", err)
	}
}

// latency is figure 3 (and the CPU of figure 6 at a fixed rate): the same open-loop rate
// direct and through each contender. For P/D the direct path is the client making the
// prefill and the decode call itself, so the difference is what the proxy adds.
func (h *harness) latency(t *testing.T, mode string) {
	p := h.p
	cs := h.contenders(mode)
	mt, closeAll := h.targets(mode, cs, 256, nil)
	defer closeAll()
	for _, s := range append([]*attackSpec{&mt.direct, &mt.directPair}, pointers(mt.via)...) {
		s.rate, s.workers, s.dur = p.rate, 16, p.rateDur
	}
	base := mt.direct
	if mode == "pd" {
		base = mt.directPair
	}
	d := attack(base)
	checkStreams(t, mode+" direct", d)
	if len(d.latencies) == 0 {
		t.Fatalf("%s latency: no direct samples", mode)
	}
	for i, c := range cs {
		before, err := c.cpu()
		if err != nil {
			t.Fatal(err)
		}
		var prof sync.WaitGroup
		if secs := int(p.rateDur.Seconds()) - 1; i == 0 && h.profileDir != "" && secs > 0 {
			prof.Go(func() {
				file := filepath.Join(h.profileDir, "cpu-"+mode+"-rate.pprof")
				if err := h.proxy[mode].profile(fmt.Sprintf("profile?seconds=%d", secs), file); err != nil {
					t.Errorf("cpu profile: %v", err)
				}
			})
		}
		x := attack(mt.via[i])
		prof.Wait()
		after, err := c.cpu()
		if err != nil {
			t.Fatal(err)
		}
		checkStreams(t, mode+" via "+c.name, x)
		if len(x.latencies) == 0 {
			t.Fatalf("%s latency via %s: no samples", mode, c.name)
		}
		added50, added99 := x.quantile(0.50)-d.quantile(0.50), x.quantile(0.99)-d.quantile(0.99)
		fig, target, met := "3. aggregated latency at "+strconv.Itoa(p.rate)+" req/s, via "+c.name, "(no target)", ""
		if mode == "pd" {
			fig = "3. P/D latency at " + strconv.Itoa(p.rate) + " req/s (direct: the client's own prefill+decode), via " + c.name
			if i == 0 {
				target = "added p50 <= 0.5 ms, p99 <= 2 ms"
				met = h.rep.met(added50 <= 500*time.Microsecond && added99 <= 2*time.Millisecond)
			}
		}
		h.rep.add(row{fig,
			fmt.Sprintf("p50 %s p99 %s", ms(d.quantile(0.50)), ms(d.quantile(0.99))),
			fmt.Sprintf("p50 %s p99 %s", ms(x.quantile(0.50)), ms(x.quantile(0.99))),
			fmt.Sprintf("added p50 %s p99 %s (%d/%d samples)", ms(added50), ms(added99), len(d.latencies), len(x.latencies)),
			target, met})
		if x.ok > 0 {
			h.rep.add(row{"6. CPU per 1,000 requests at " + strconv.Itoa(p.rate) + " req/s, " + mode + ", " + c.name, "", fmt.Sprintf("%.3f s", (after-before)/float64(x.ok)*1000), "", "(no target)", ""})
		}
	}
}

// abort is figure 4: under a fixed background load through the proxy, probe requests whose
// client disconnects, timed from the disconnect to the backend seeing its connection closed,
// in the decode and in the prefill stage; the same probes straight to the backend are the
// floor (Go noticing a closed connection at all).
func (h *harness) abort(t *testing.T, proc *proxyProc) {
	p := h.p
	bgClient := newClient(256)
	defer bgClient.CloseIdleConnections()
	attacker, results := start(attackSpec{client: bgClient, url: proc.url + "/v1/completions", body: h.body, rate: p.rate, workers: 16, dur: 10 * time.Minute})
	bgDone := make(chan loadResult, 1)
	began := time.Now()
	go func() { bgDone <- collect(results, began) }()

	probeClient := newClient(4)
	defer probeClient.CloseIdleConnections()
	prefillBody, err := prefillBodyOf(h.body)
	if err != nil {
		t.Fatal(err)
	}
	type path struct {
		name, stage, url string
		body             []byte
		be               *backend
	}
	paths := []path{
		{"direct", "decode", h.decode.URL(), h.body, h.decode},
		{"proxy", "decode", proc.url, h.body, h.decode},
		{"direct", "prefill", h.prefill.URL(), prefillBody, h.prefill},
		{"proxy", "prefill", proc.url, h.body, h.prefill},
	}
	got := map[string][]time.Duration{}
	for _, pa := range paths {
		var missed int
		for i := 0; i < p.probes; i++ {
			d, err := probeAbort(probeClient, pa.url+"/v1/completions", pa.body, pa.be, pa.stage, fmt.Sprintf("probe-%s-%s-%d", pa.name, pa.stage, i))
			if err != nil {
				missed++
				if missed == 1 {
					t.Errorf("abort probe %s %s: %v", pa.name, pa.stage, err)
				}
			} else {
				got[pa.name+pa.stage] = append(got[pa.name+pa.stage], d)
			}
			time.Sleep(p.probeGap)
		}
	}
	attacker.Stop()
	bg := <-bgDone
	checkStreams(t, "background load", bg)
	for _, stage := range []string{"decode", "prefill"} {
		d, x := got["direct"+stage], got["proxy"+stage]
		slices.Sort(d)
		slices.Sort(x)
		if len(d) == 0 || len(x) == 0 {
			t.Errorf("abort %s: no measurement", stage)
			continue
		}
		h.rep.add(row{"4. abort propagation in " + stage + ", client disconnect to the backend's r.Context().Done(), under " + strconv.Itoa(p.rate) + " req/s",
			fmt.Sprintf("p50 %s p99 %s", ms(q(d, 0.5)), ms(q(d, 0.99))),
			fmt.Sprintf("p50 %s p99 %s max %s", ms(q(x, 0.5)), ms(q(x, 0.99)), ms(x[len(x)-1])),
			fmt.Sprintf("%d probes; load %.0f req/s, %d streams", len(x), bg.rate(), bg.ok),
			"proxy p99 <= 5 ms", h.rep.met(q(x, 0.99) <= 5*time.Millisecond)})
	}
}

func prefillBodyOf(body []byte) ([]byte, error) {
	f, err := engine.ParseFields(body)
	if err != nil {
		return nil, err
	}
	return engine.PrefillBody(f, engine.APICompletions)
}

var errNoClose = errors.New("the backend never saw the connection close")

// probeAbort sends one request the backend holds open (a slow stream in decode, a stalled
// prefill), disconnects once the backend has it (and, in decode, once its first chunk
// arrived), and returns how long the backend took to see the disconnect.
func probeAbort(client *http.Client, url string, body []byte, be *backend, stage, id string) (time.Duration, error) {
	pr := be.watch(id)
	defer be.unwatch(id)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	if stage == "decode" {
		req.Header.Set(hdrInterval, "5ms")
	} else {
		req.Header.Set(hdrPrefillStall, "1")
	}
	type answer struct {
		resp *http.Response
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := client.Do(req)
		done <- answer{resp, err}
	}()
	var resp *http.Response
	closeResp := func() {
		if resp != nil {
			resp.Body.Close()
		}
	}
	timeout := time.NewTimer(10 * time.Second)
	defer timeout.Stop()
	if stage == "decode" {
		select {
		case a := <-done:
			if a.err != nil {
				return 0, a.err
			}
			resp = a.resp
		case <-timeout.C:
			cancel()
			a := <-done
			resp = a.resp
			closeResp()
			return 0, errors.New("no answer")
		}
		var first [256]byte
		if _, err := resp.Body.Read(first[:]); err != nil {
			closeResp()
			return 0, fmt.Errorf("first chunk: %w", err)
		}
	}
	select {
	case <-pr.started:
	case <-timeout.C:
		cancel()
		resp = (<-done).resp
		closeResp()
		return 0, errors.New("the backend never started the request")
	}
	t0 := time.Now()
	cancel()
	if stage != "decode" {
		resp = (<-done).resp
	}
	closeResp()
	select {
	case t1 := <-pr.closed:
		return t1.Sub(t0), nil
	case <-timeout.C:
		return 0, errNoClose
	}
}

// scale is figure 5: many slow streams open at once through a fresh proxy process, its
// resident memory and goroutines per stream, and /health answering meanwhile.
func (h *harness) scale(t *testing.T) {
	p := h.p
	proc := startProxy(t, childConfig{Decode: []string{h.decode.URL()}, MaxInflight: p.streams + 1024, NoFile: uint64(2*p.streams + fdSlack)})
	warm := newClient(8)
	checkStreams(t, "warm-up", attack(attackSpec{client: warm, url: proc.url + "/v1/completions", body: h.body, workers: 8, dur: 200 * time.Millisecond}))
	warm.CloseIdleConnections()
	base, err := proc.sample()
	if err != nil {
		t.Fatal(err)
	}

	// /health, every healthEvery, from the first stream opening until they close: the calls
	// made while every stream is open (the hold) apart from those made while they open.
	var holding atomic.Bool
	healthStop := make(chan struct{})
	healthDone := make(chan [2][]time.Duration, 1)
	go func() {
		c := newClient(1)
		defer c.CloseIdleConnections()
		var lat [2][]time.Duration // opening, holding
		tick := time.NewTicker(p.healthEvery)
		defer tick.Stop()
		for {
			select {
			case <-healthStop:
				healthDone <- lat
				return
			case <-tick.C:
			}
			phase := 0
			if holding.Load() {
				phase = 1
			}
			t0 := time.Now()
			resp, err := c.Get(proc.url + "/health")
			if err != nil {
				continue
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				lat[phase] = append(lat[phase], time.Since(t0))
			}
		}
	}()

	streamClient := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 1, DisableCompression: true}}
	defer streamClient.CloseIdleConnections()
	var (
		opened, failed atomic.Int64
		firstErr       atomic.Value
		openWG, doneWG sync.WaitGroup
		release        = make(chan struct{})
		dialing        = make(chan struct{}, 256) // streams being opened at once
	)
	openStart := time.Now()
	for i := 0; i < p.streams; i++ {
		openWG.Add(1)
		doneWG.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			dialing <- struct{}{}
			resp, err := slowStream(ctx, streamClient, proc.url, h.body, p.interval, i)
			<-dialing
			if err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
				openWG.Done()
				return
			}
			opened.Add(1)
			openWG.Done()
			<-release
			cancel()
			resp.Body.Close()
		})
	}
	allOpen := make(chan struct{})
	go func() { openWG.Wait(); close(allOpen) }()
	select {
	case <-allOpen:
	case <-time.After(p.openBudget):
		t.Errorf("scale: %d of %d streams open after %s", opened.Load(), p.streams, p.openBudget)
	}
	openTime := time.Since(openStart)
	holding.Store(true)
	holdStart, err := proc.sample()
	if err != nil {
		t.Error(err)
	}
	time.Sleep(p.hold)
	if h.profileDir != "" {
		for name, file := range map[string]string{"heap?gc=1": "heap-streams.pprof", "goroutine": "goroutine-streams.pprof"} {
			if err := proc.profile(name, filepath.Join(h.profileDir, file)); err != nil {
				t.Errorf("%s profile: %v", name, err)
			}
		}
	}
	full, err := proc.sample()
	if err != nil {
		t.Error(err)
	}
	holding.Store(false)
	close(release)
	doneWG.Wait()
	<-allOpen
	close(healthStop)
	healths := <-healthDone
	opening, health := healths[0], healths[1]
	// The backend sees every stream end; until then the proxy still holds them.
	deadline := time.Now().Add(time.Minute)
	for h.decode.active.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := failed.Load(); n > 0 {
		t.Errorf("scale: %d streams failed to open (first: %v)", n, firstErr.Load())
	}
	n := float64(opened.Load())
	if n == 0 || len(health) == 0 {
		t.Fatalf("scale: %v streams open, %d /health answers: no figure", n, len(health))
	}
	slices.Sort(health)
	slices.Sort(opening)
	perStream := (full.rss - base.rss) / n
	h.rep.add(row{fmt.Sprintf("5. %d concurrent slow streams%s (a chunk every %s): proxy memory per stream", int(n), p.streamsCap, p.interval), "",
		fmt.Sprintf("RSS %.1f KiB, heap %.1f KiB, stacks %.1f KiB, %.2f goroutines", perStream/1024, (full.heapInuse-base.heapInuse)/n/1024, (full.stackInuse-base.stackInuse)/n/1024, (full.goroutines-base.goroutines)/n),
		fmt.Sprintf("RSS %.0f MiB with them, %.0f MiB before; opened in %s", full.rss/(1<<20), base.rss/(1<<20), openTime.Round(time.Millisecond)),
		"<= 48 KiB per stream", h.rep.met(perStream <= 48*1024)})
	h.rep.add(row{fmt.Sprintf("5. /health while they are all open and stream (%s)", p.hold), "",
		fmt.Sprintf("p50 %s p99 %s max %s", ms(q(health, 0.5)), ms(q(health, 0.99)), ms(health[len(health)-1])),
		fmt.Sprintf("%d calls; proxy CPU meanwhile %.2f cores", len(health), (full.cpuSeconds-holdStart.cpuSeconds)/p.hold.Seconds()),
		"p99 < 10 ms", h.rep.met(q(health, 0.99) < 10*time.Millisecond)})
	if len(opening) > 0 {
		h.rep.add(row{"5b. /health while the streams open (all at once, 256 at a time)", "",
			fmt.Sprintf("p50 %s p99 %s max %s", ms(q(opening, 0.5)), ms(q(opening, 0.99)), ms(opening[len(opening)-1])),
			fmt.Sprintf("%d calls", len(opening)), "(no target)", ""})
	}
}

// slowStream opens a stream whose backend sends a chunk every interval, and returns once
// the first chunk arrived.
func slowStream(ctx context.Context, c *http.Client, url string, body []byte, interval time.Duration, i int) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(hdrInterval, interval.String())
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("stream %d: %w", i, err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("stream %d: status %d", i, resp.StatusCode)
	}
	var first [256]byte
	if _, err := resp.Body.Read(first[:]); err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("stream %d: first chunk: %w", i, err)
	}
	return resp, nil
}

// medianOf is the median over rounds of f of each.
func medianOf[R any](rounds []R, f func(R) float64) float64 {
	var xs []float64
	for _, r := range rounds {
		xs = append(xs, f(r))
	}
	return median(xs)
}

// spanOf is the lowest and highest over rounds of f of each, in format, bracketed, where
// there is more than one round.
func spanOf[R any](rounds []R, format string, f func(R) float64) string {
	if len(rounds) < 2 {
		return ""
	}
	lo, hi := f(rounds[0]), f(rounds[0])
	for _, r := range rounds[1:] {
		lo, hi = min(lo, f(r)), max(hi, f(r))
	}
	return fmt.Sprintf(" ("+format+"–"+format+")", lo, hi)
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// quotients divides a by b round by round.
func quotients(a, b []float64) []float64 {
	var q []float64
	for i := range min(len(a), len(b)) {
		if b[i] > 0 {
			q = append(q, a[i]/b[i])
		}
	}
	return q
}

// spread says how far apart rounds were: all of them when few, else the lowest and highest.
func spread(xs []float64) string {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) > 4 {
		return fmt.Sprintf("%.2f..%.2f over %d", s[0], s[len(s)-1], len(s))
	}
	var parts []string
	for _, x := range xs {
		parts = append(parts, fmt.Sprintf("%.2f", x))
	}
	return strings.Join(parts, " ")
}

// q is the nearest-rank quantile of sorted durations.
func q(sorted []time.Duration, x float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(x*float64(len(sorted))+0.5) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond)) }

// report is the table a harness run prints.
type report struct {
	params params
	mu     sync.Mutex
	rows   []row
}

type row struct{ figure, direct, proxy, result, target, met string }

func (r *report) add(x row) {
	r.mu.Lock()
	r.rows = append(r.rows, x)
	r.mu.Unlock()
}

// met says whether a target is met; a tiny run is too short to say.
func (r *report) met(ok bool) string {
	switch {
	case r.params.name != "full":
		return "n/a (tiny run)"
	case ok:
		return "met"
	}
	return "NOT met"
}

func (r *report) write(t *testing.T) {
	var b strings.Builder
	cpu := "unknown CPU"
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(data), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				cpu = strings.TrimSpace(v)
				break
			}
		}
	}
	fmt.Fprintf(&b, "\npdproxy harness (%s run), %s, %d CPUs (%s), %s, %s\n\n", r.params.name, time.Now().UTC().Format(time.RFC3339), runtime.NumCPU(), cpu, runtime.Version(), runtime.GOARCH)
	fmt.Fprintf(&b, "| figure | direct | via proxy | result | target | |\n|---|---|---|---|---|---|\n")
	for _, x := range r.rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", x.figure, x.direct, x.proxy, x.result, x.target, x.met)
	}
	fmt.Print(b.String())
	if out := os.Getenv("PDPROXY_BENCH_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}
