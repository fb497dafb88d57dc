package bench

import (
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// sharedParams sizes TestSharedState: the tiny run (every `go test`) shows that each figure is
// taken; PDPROXY_BENCH_SHARED=full is the measurement.
type sharedParams struct {
	name      string
	offered   int           // requests per second, open loop, alternating replicas
	limit     int           // the key's requests_per_second and burst
	dur       time.Duration // of the limit's and the outage's runs
	costRate  int           // requests per second of the cost rounds
	costDur   time.Duration // of each cost round
	costRound int           // rounds, shared and alone alternating
}

func sharedParamsOf() sharedParams {
	if os.Getenv("PDPROXY_BENCH_SHARED") == "full" {
		return sharedParams{name: "full", offered: 300, limit: 50, dur: 20 * time.Second, costRate: 200, costDur: 5 * time.Second, costRound: 3}
	}
	return sharedParams{name: "tiny", offered: 60, limit: 10, dur: 2 * time.Second, costRate: 40, costDur: time.Second, costRound: 1}
}

// TestSharedState measures what shared_state does for three replicas (app.Main, each with its
// own fast simulated prefiller and decoder) behind a client that alternates between them
// request by request, open loop (vegeta), sharing one real redis-server:
//
//   - a global limit: one key limited to p.limit requests per second (burst p.limit) under
//     p.offered requests per second, with shared_state and without it; the rate let through
//     after the burst, against the limit;
//   - Redis killed a third into a run and restarted two thirds into it (by the answers
//     counted), the key's limit out
//     of the load's reach: the requests that failed, the checks decided alone, and how long
//     after the restart every replica shared again;
//   - the cost: each request's latency with shared_state and without it, rounds alternating,
//     and the check's own duration as the replicas' histograms have it.
//
// It asserts what a user would notice: every request answered 200 or 429 with Retry-After
// (none failed, Redis dead or not), every replica back on the shared state after the restart.
// PDPROXY_BENCH_SHARED=full is the measurement (300 req/s offered against 50 for 20 s; cost
// rounds of 5 s at 200 req/s); PDPROXY_BENCH_SHARED_OUT=FILE also writes the table.
func TestSharedState(t *testing.T) {
	p := sharedParamsOf()
	srv := redistest.Start(t)
	var rows []string
	limits := proxy.KeyLimits{RequestsPerSecond: float64(p.limit), Burst: p.limit}

	for _, shared := range []bool{true, false} {
		ms := sharedReplicaSet(t, srv.Addr(), shared, limits)
		r := sharedAttack(t, ms, p.offered, p.dur, nil)
		rate := float64(r.ok-p.limit) / p.dur.Seconds()
		name := "3 replicas sharing the limit"
		if !shared {
			name = "3 replicas, each alone"
		}
		rows = append(rows, fmt.Sprintf("| %s | %d req/s | %d | %d | %d | %.1f req/s | %.2f | %d |", name, p.offered, r.ok, r.refused, r.failed,
			rate, rate/float64(p.limit), checkErrors(t, ms)))
	}

	// Redis dies and comes back mid-run; the limit is out of the load's reach.
	ms := sharedReplicaSet(t, srv.Addr(), true, proxy.KeyLimits{RequestsPerSecond: 100 * float64(p.offered), Burst: 100 * p.offered})
	// Redis dies once a third of the run's requests are answered, and comes back at two
	// thirds: the time it is back is taken apart, as the answers go on arriving.
	var back time.Duration
	total := int(float64(p.offered) * p.dur.Seconds())
	restarted, restarting := make(chan struct{}), false
	r := sharedAttack(t, ms, p.offered, p.dur, func(answered int) {
		switch answered {
		case total / 3:
			srv.Stop()
		case 2 * total / 3:
			restarting = true
			go func() {
				defer close(restarted)
				srv.Restart()
				at := time.Now()
				for i, m := range ms {
					testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
						v := testutil.Value(t, m.Registry, "pdproxy_shared_state_up", nil)
						return v == 1, fmt.Sprintf("replica %d: pdproxy_shared_state_up = %v after Redis came back", i, v)
					})
				}
				back = time.Since(at)
			}()
		}
	})
	if !restarting {
		t.Fatalf("the run ended after %d answers, before two thirds of %d: Redis was never restarted", r.ok+r.refused+r.failed, total)
	}
	<-restarted
	outage := fmt.Sprintf("| Redis killed a third into the run, restarted at two thirds | %d req/s | %d | %d | %d | every replica sharing again %.0f ms after the restart | | %d |",
		p.offered, r.ok, r.refused, r.failed, msf(back), checkErrors(t, ms))

	// The cost: the same load with shared_state and without, rounds alternating.
	cost := map[bool][]time.Duration{}
	var costShared []*app.Main
	high := proxy.KeyLimits{RequestsPerSecond: 100 * float64(p.costRate), Burst: 100 * p.costRate, MaxConcurrent: 10000}
	for round := range p.costRound {
		for _, shared := range []bool{round%2 == 0, round%2 != 0} {
			ms := sharedReplicaSet(t, srv.Addr(), shared, high)
			r := sharedAttack(t, ms, p.costRate, p.costDur, nil)
			if r.refused != 0 {
				t.Errorf("cost round: %d requests refused under a limit out of reach", r.refused)
			}
			cost[shared] = append(cost[shared], r.latencies...)
			if shared {
				costShared = append(costShared, ms...)
			}
		}
	}
	for _, l := range cost {
		slices.Sort(l)
	}
	check50, check99 := histogramQuantile(t, costShared, "pdproxy_shared_state_check_duration_seconds", 0.5),
		histogramQuantile(t, costShared, "pdproxy_shared_state_check_duration_seconds", 0.99)

	table := fmt.Sprintf("shared state (%s): 3 replicas, a client alternating them, one key limited to %d req/s (burst %d)\n\n", p.name, p.limit, p.limit) +
		"| run | offered | 200 | 429 | failed | let through after the burst | of the limit | checks decided alone |\n|---|---|---|---|---|---|---|---|\n" +
		strings.Join(rows, "\n") + "\n" + outage + "\n\n" +
		fmt.Sprintf("cost at %d req/s (%d rounds of %v each way): latency p50 / p99 with shared_state %.2f / %.2f ms, without %.2f / %.2f ms; "+
			"the check itself p50 ≤ %.2f ms, p99 ≤ %.2f ms (histogram buckets' upper bounds)\n",
			p.costRate, p.costRound, p.costDur, msf(q(cost[true], 0.5)), msf(q(cost[true], 0.99)), msf(q(cost[false], 0.5)), msf(q(cost[false], 0.99)),
			check50*1000, check99*1000)
	t.Log("\n" + table)
	if out := os.Getenv("PDPROXY_BENCH_SHARED_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// sharedReplicaSet starts three replicas of the embedded default, fast sims each, with limits
// per key, sharing them through the Redis at addr when shared is set.
func sharedReplicaSet(t *testing.T, addr string, shared bool, limits proxy.KeyLimits) []*app.Main {
	t.Helper()
	var ms []*app.Main
	for range 3 {
		cfg := app.DefaultConfig()
		cfg.Listen, cfg.ShutdownTimeout = "127.0.0.1:0", 5*time.Second
		for i := range cfg.Sims {
			cfg.Sims[i].PrefillTime, cfg.Sims[i].ITL = time.Millisecond, time.Millisecond
		}
		cfg.Proxy.Limits = proxy.LimitsConfig{PerKey: limits}
		if shared {
			cfg.SharedState = sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: addr}}
		}
		ms = append(ms, startMain(t, cfg))
	}
	return ms
}

// sharedResult is one attack on the replicas.
type sharedResult struct {
	ok, refused, failed int
	latencies           []time.Duration // of the 200s, sorted
}

// sharedAttack offers rate requests per second of one key for dur, alternating the replicas,
// calling answered (if any) with the count of answers so far after each; a 429 without
// Retry-After counts as failed.
func sharedAttack(t *testing.T, ms []*app.Main, rate int, dur time.Duration, answered func(n int)) sharedResult {
	t.Helper()
	client := newClient(256)
	defer client.CloseIdleConnections()
	var tgts []vegeta.Target
	for _, m := range ms {
		tgts = append(tgts, vegeta.Target{Method: http.MethodPost, URL: m.URL() + "/v1/completions",
			Body:   []byte(`{"model":"sim","prompt":"hi","max_tokens":1}`),
			Header: http.Header{"Content-Type": {"application/json"}, "Authorization": {"Bearer team-key"}}})
	}
	a := vegeta.NewAttacker(vegeta.Client(client), vegeta.Workers(16))
	results := a.Attack(vegeta.NewStaticTargeter(tgts...), vegeta.Rate{Freq: rate, Per: time.Second}, dur, "")
	var r sharedResult
	firstErr := ""
	for n := 1; ; n++ {
		res, ok := <-results
		if !ok {
			break
		}
		if answered != nil {
			answered(n)
		}
		switch {
		case res.Code == http.StatusOK && res.Error == "":
			r.ok++
			r.latencies = append(r.latencies, res.Latency)
		case res.Code == http.StatusTooManyRequests && res.Headers.Get("Retry-After") != "":
			r.refused++
		default:
			r.failed++
			if firstErr == "" {
				firstErr = fmt.Sprintf("status %d %s: %.200s", res.Code, res.Error, res.Body)
			}
		}
	}
	if r.failed > 0 {
		t.Errorf("%d of %d requests failed; the first: %s", r.failed, r.ok+r.refused+r.failed, firstErr)
	}
	slices.Sort(r.latencies)
	return r
}

// checkErrors is the replicas' checks that Redis did not decide.
func checkErrors(t *testing.T, ms []*app.Main) int {
	n := 0.0
	for _, m := range ms {
		n += testutil.Value(t, m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"})
	}
	return int(n)
}

// histogramQuantile is the upper bound of the bucket holding the q-th observation of the
// histogram name, summed over the replicas' registries; NaN when there is none.
func histogramQuantile(t *testing.T, ms []*app.Main, name string, quantile float64) float64 {
	t.Helper()
	buckets := map[float64]uint64{}
	var count uint64
	for _, m := range ms {
		mfs, err := m.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
			for _, metric := range mf.GetMetric() {
				h := metric.GetHistogram()
				count += h.GetSampleCount()
				for _, b := range h.GetBucket() {
					buckets[b.GetUpperBound()] += b.GetCumulativeCount()
				}
			}
		}
	}
	bounds := make([]float64, 0, len(buckets))
	for b := range buckets {
		bounds = append(bounds, b)
	}
	slices.Sort(bounds)
	for _, b := range bounds {
		if float64(buckets[b]) >= quantile*float64(count) && count > 0 {
			return b
		}
	}
	return math.NaN()
}
