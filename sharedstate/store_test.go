package sharedstate

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// replica is one Store as a proxy replica runs it: its goroutine running, its own registry
// and log.
type replica struct {
	*Store
	t    *testing.T
	reg  *prometheus.Registry
	logs *observer.ObservedLogs
	stop func() // ends Run and closes the Store, releasing nothing: a killed replica
}

// generous is a budget a loaded test machine meets on loopback, for the tests that are about
// sharing and not about the budget.
var generous = MaxTimeout

// startReplica starts a Store on the server at addr, with cfg's keys over the defaults, and
// stops it when the test ends. Each of adjust changes the Store before its goroutine starts.
func startReplica(t *testing.T, addr string, cfg Config, adjust ...func(*Store)) *replica {
	t.Helper()
	cfg.Redis.Addr = addr
	if cfg.Redis.Timeout == nil {
		cfg.Redis.Timeout = &generous
	}
	core, logs := observer.New(zapcore.InfoLevel)
	logger := zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Core()))
	reg := prometheus.NewRegistry()
	s, err := New(cfg, logger, reg)
	if err != nil {
		t.Fatalf("new store: %v", err)
	}
	for _, f := range adjust {
		f(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Run(ctx)
	}()
	var once sync.Once
	r := &replica{Store: s, t: t, reg: reg, logs: logs, stop: func() {
		once.Do(func() {
			cancel()
			<-done
			s.Close()
		})
	}}
	t.Cleanup(r.stop)
	return r
}

// decided is r's answer to req once Redis decided it: a check that failed (a loaded machine
// can miss even the generous budget) gives its slot back and is asked again.
func decided(t *testing.T, r *replica, req Request) Decision {
	t.Helper()
	var d Decision
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		var err error
		if d, err = r.Check(context.Background(), req); err != nil {
			r.Release(d.Slot)
			return false, fmt.Sprintf("a check Redis decides: %v", err)
		}
		return true, ""
	})
	return d
}

func (r *replica) errors(op string) float64 {
	return testutil.Value(r.t, r.reg, "pdproxy_shared_state_errors_total", map[string]string{"op": op})
}

func (r *replica) logged(msg string) int { return r.logs.FilterMessage(msg).Len() }

func TestConfigDefaultsAndRefusals(t *testing.T) {
	dur := func(d time.Duration) *time.Duration { return &d }
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	os.WriteFile(empty, []byte("\n"), 0o600)
	for _, tc := range []struct {
		name string
		cfg  Config
		want string // a part of the error; "" for none
	}{
		{"nothing set is no shared state", Config{}, ""},
		{"an address alone takes the defaults", Config{Redis: RedisConfig{Addr: "redis:6379"}}, ""},
		{"a budget of 100ms is the most", Config{Redis: RedisConfig{Addr: "redis:6379", Timeout: dur(MaxTimeout)}}, ""},
		{"a budget of 0 is refused", Config{Redis: RedisConfig{Addr: "redis:6379", Timeout: dur(0)}}, "shared_state.redis.timeout: 0s is not positive"},
		{"a negative budget is refused", Config{Redis: RedisConfig{Addr: "redis:6379", Timeout: dur(-time.Millisecond)}}, "shared_state.redis.timeout: -1ms is not positive"},
		{"a budget above 100ms is refused", Config{Redis: RedisConfig{Addr: "redis:6379", Timeout: dur(101 * time.Millisecond)}}, "shared_state.redis.timeout: 101ms is more than 100ms"},
		{"keys without an address are refused", Config{SlotTTL: time.Minute}, "shared_state.redis.addr: required"},
		{"an address without a port is refused", Config{Redis: RedisConfig{Addr: "redis"}}, "is not host:port"},
		{"a slot TTL under 3s is refused", Config{Redis: RedisConfig{Addr: "redis:6379"}, SlotTTL: time.Second}, "shared_state.slot_ttl: 1s is less than 3s"},
		{"a negative db is refused", Config{Redis: RedisConfig{Addr: "redis:6379", DB: -1}}, "shared_state.redis.db"},
		{"a long key prefix is refused", Config{Redis: RedisConfig{Addr: "redis:6379", KeyPrefix: strings.Repeat("p", 65)}}, "key_prefix"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
	c, err := Config{Redis: RedisConfig{Addr: "redis:6379"}}.WithDefaults()
	if err != nil || *c.Redis.Timeout != 5*time.Millisecond || c.SlotTTL != 30*time.Second || c.Redis.KeyPrefix != "pdproxy:" {
		t.Errorf("defaults: timeout %v, slot_ttl %s, key_prefix %q, %v; want 5ms, 30s, pdproxy:", c.Redis.Timeout, c.SlotTTL, c.Redis.KeyPrefix, err)
	}
	for _, f := range []string{filepath.Join(dir, "missing"), empty} {
		if _, err := New(Config{Redis: RedisConfig{Addr: "redis:6379", PasswordFile: f}}, zap.NewNop(), prometheus.NewRegistry()); err == nil || !strings.Contains(err.Error(), "password_file") {
			t.Errorf("password file %s: %v, want an error naming password_file", f, err)
		}
	}
}

// hammer checks req from every replica, each on its own goroutine, every couple of
// milliseconds for d, and returns what each was allowed and the time it took. A failed
// check fails the test: these runs are about sharing, with Redis up.
func hammer(t *testing.T, d time.Duration, req Request, rs ...*replica) (allowed []int, elapsed time.Duration) {
	t.Helper()
	allowed = make([]int, len(rs))
	var wg sync.WaitGroup
	start := time.Now()
	errs := make(chan error, len(rs))
	for i, r := range rs {
		wg.Go(func() {
			tick := time.NewTicker(2 * time.Millisecond)
			defer tick.Stop()
			for ; time.Since(start) < d; <-tick.C {
				dec, err := r.Check(context.Background(), req)
				if err != nil {
					errs <- err
					return
				}
				if dec.Allowed {
					allowed[i]++
				} else if dec.Reason != ReasonRate || dec.RetryAfter <= 0 || dec.RetryAfter > time.Duration(float64(time.Second)/req.Rate)+time.Millisecond {
					errs <- fmt.Errorf("refusal %+v: want reason rate and a Retry-After within one interval", dec)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return allowed, time.Since(start)
}

func within(got, want, share float64) bool { return math.Abs(got-want) <= share*want }

func TestGCRAHoldsTheRateWithinTenPercent(t *testing.T) {
	srv := redistest.Start(t)
	r := startReplica(t, srv.Addr(), Config{})
	req := Request{Key: "client", Rate: 20, Burst: 5}
	allowed, elapsed := hammer(t, 2500*time.Millisecond, req, r)
	want := float64(req.Burst) + req.Rate*elapsed.Seconds()
	if !within(float64(allowed[0]), want, 0.1) {
		t.Fatalf("allowed %d in %s at %g/s with a burst of %d, want %.0f ± 10%%", allowed[0], elapsed, req.Rate, req.Burst, want)
	}
}

func TestThreeReplicasShareOneKeysRate(t *testing.T) {
	srv := redistest.Start(t)
	rs := []*replica{startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})}
	req := Request{Key: "client", Rate: 10, Burst: 5}
	allowed, elapsed := hammer(t, 2*time.Second, req, rs...)
	total := allowed[0] + allowed[1] + allowed[2]
	want := float64(req.Burst) + req.Rate*elapsed.Seconds()
	if !within(float64(total), want, 0.1) {
		t.Fatalf("three replicas allowed %v (%d) in %s at %g/s with a burst of %d, want %.0f ± 10%% in all: one key's limit, not three", allowed, total, elapsed, req.Rate, req.Burst, want)
	}
	// Another key has its own schedule.
	if d, err := rs[0].Check(context.Background(), Request{Key: "another", Rate: 10, Burst: 5}); err != nil || !d.Allowed {
		t.Fatalf("another key: %+v, %v", d, err)
	}
}

func TestThreeReplicasShareOneKeysConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	rs := []*replica{startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})}
	req := Request{Key: "client", MaxConcurrent: 3}
	var slots []Slot
	for i, r := range rs {
		d, err := r.Check(context.Background(), req)
		if err != nil || !d.Allowed || d.Slot == (Slot{}) {
			t.Fatalf("replica %d's first request: %+v, %v", i, d, err)
		}
		slots = append(slots, d.Slot)
	}
	for i, r := range rs {
		d, err := r.Check(context.Background(), req)
		if err != nil || d.Allowed || d.Reason != ReasonConcurrency || d.RetryAfter != time.Second || d.Slot != (Slot{}) {
			t.Fatalf("replica %d's request over three in flight: %+v, %v; want a concurrency refusal, Retry-After 1s, no slot", i, d, err)
		}
	}
	// A slot given back on one replica is free on every one, once the release is sent.
	rs[1].Release(slots[1])
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := rs[0].Check(context.Background(), req)
		return err == nil && d.Allowed, fmt.Sprintf("a request after a release elsewhere: %+v, %v", d, err)
	})
	if d, err := rs[2].Check(context.Background(), req); err != nil || d.Allowed {
		t.Fatalf("a fourth request with three in flight again: %+v, %v", d, err)
	}
	for _, r := range rs {
		if v := r.errors(opCheck); v != 0 {
			t.Errorf("check errors %v, want 0", v)
		}
	}
}

func TestAKilledReplicasSlotsComeBackWithinTheTTLWhileALiveOnesStay(t *testing.T) {
	srv := redistest.Start(t)
	const ttl = 3 * time.Second
	cfg := Config{SlotTTL: ttl}
	live, killed, other := startReplica(t, srv.Addr(), cfg), startReplica(t, srv.Addr(), cfg), startReplica(t, srv.Addr(), cfg)
	req := Request{Key: "client", MaxConcurrent: 3}
	start := time.Now()
	for _, r := range []*replica{live, killed, killed} {
		if d := decided(t, r, req); !d.Allowed {
			t.Fatalf("taking a slot: %+v", d)
		}
	}
	if d := decided(t, other, req); d.Allowed {
		t.Fatal("a fourth slot of three was given")
	}
	killed.stop() // its two slots are never released
	killedAt := time.Now()
	testutil.WaitFor(t, 3*ttl, func() (bool, string) {
		d, err := other.Check(context.Background(), req)
		other.Release(d.Slot) // whatever the answer: a check that timed out may hold one
		return err == nil && d.Allowed, fmt.Sprintf("a slot while the killed replica's are still there: %+v, %v", d, err)
	})
	lastCheck := time.Now()
	if back := time.Since(killedAt); back > ttl+time.Second {
		t.Errorf("the killed replica's slots came back %s after it died, want within its TTL %s", back, ttl)
	}
	// The live replica's slot, older than its TTL by now, is still held: its replica
	// refreshes it. The others are free again, a slot that a check over its budget took
	// behind the release sent for it among them, once its own TTL has passed.
	// No event marks a TTL passing.
	<-time.After(max(time.Until(start.Add(ttl*3/2)), time.Until(lastCheck.Add(ttl+100*time.Millisecond))))
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		// Slots not yet expired: a score is its slot's deadline in µs of Redis's clock, this one.
		n, err := srv.Do("ZCOUNT", other.key("slots", "client"), fmt.Sprintf("(%d", time.Now().UnixMicro()), "+inf")
		return err == nil && n == ":1", fmt.Sprintf("slots held in Redis: %s %v, want the live replica's 1", n, err)
	})
	var got []Slot
	for range 3 {
		if d := decided(t, other, req); d.Allowed {
			got = append(got, d.Slot)
		}
	}
	if len(got) != 2 {
		t.Fatalf("%d slots given next to a live replica's, %s after it took it, with a TTL of %s; want 2 of 3", len(got), time.Since(start), ttl)
	}
}

// onlyTheBudget leaves a check's budget the only bound on its wait for Redis: go-redis's own
// timeouts (a second) would end a call to a silent server too, later. A check that returns
// from a server that never answers was then ended by its budget.
func onlyTheBudget(s *Store) {
	o := s.rdb.Options()
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Hour, time.Hour, time.Hour
}

// checkEnds is r's answer to req, which must come: only a hang (a wait for Redis that
// nothing bounds) makes it miss testutil.Timeout.
func checkEnds(t *testing.T, r *replica, req Request) (Decision, error) {
	t.Helper()
	type answer struct {
		d   Decision
		err error
	}
	ch := make(chan answer, 1)
	go func() {
		d, err := r.Check(context.Background(), req)
		ch <- answer{d, err}
	}()
	a := testutil.Recv(t, testutil.Timeout, ch, "a check to end: its budget bounds its wait for Redis")
	return a.d, a.err
}

func TestRedisStoppedMidTestAnswersWithinTheBudgetAndComesBackShared(t *testing.T) {
	srv := redistest.Start(t)
	budget := DefaultTimeout
	// The shortest slot TTL: a release that a loaded machine's send drops (it is counted, and
	// the slot ends at its TTL, as Release says) then ends within the waits below; the slots
	// of requests in flight are refreshed every second, and stay.
	r := startReplica(t, srv.Addr(), Config{SlotTTL: minSlotTTL, Redis: RedisConfig{Timeout: &budget}}, onlyTheBudget)
	other := startReplica(t, srv.Addr(), Config{SlotTTL: minSlotTTL})
	req := Request{Key: "client", MaxConcurrent: 2, Rate: 100, Burst: 100}
	// A loaded machine may miss a 5ms budget now and then: the replica then backs off for a
	// moment; this waits until its first check goes through.
	var before Decision
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := r.Check(context.Background(), req)
		if err != nil {
			r.Release(d.Slot)
			return false, fmt.Sprintf("a check with Redis up: %v", err)
		}
		before = d
		return d.Allowed, fmt.Sprintf("a check with Redis up: %+v", d)
	})

	const outage, back = "shared state unreachable: each replica decides on its own state until it is back", "shared state reachable again"
	outagesBefore, backsBefore := r.logged(outage), r.logged(back)
	srv.Stop()
	errsBefore := r.errors(opCheck)
	var during []Slot
	for i := range 20 {
		d, err := checkEnds(t, r, req)
		if err == nil {
			t.Fatalf("check %d with Redis stopped: no error (%+v)", i, d)
		}
		// The first check finds Redis gone, unless the Store's own call found it first;
		// the others are answered by the back-off at once, with no round trip to wait for.
		if i > 0 && !errors.Is(err, ErrUnavailable) {
			t.Errorf("check %d with Redis stopped: %v; want %v: only the first may ask Redis", i, err, ErrUnavailable)
		}
		if d.Allowed || d.Slot == (Slot{}) {
			t.Fatalf("check %d with Redis stopped: %+v, want undecided with the request's slot", i, d)
		}
		during = append(during, d.Slot)
	}
	if got := r.errors(opCheck) - errsBefore; got != 20 {
		t.Errorf("check errors counted %v, want 20", got)
	}
	if n := r.logged(outage) - outagesBefore; n != 1 {
		t.Errorf("the outage was logged %d times, want once", n)
	}
	for _, sl := range during[1:] {
		r.Release(sl) // one request of the outage still in flight, with the one from before
	}

	srv.Restart()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, err := r.Check(context.Background(), Request{Key: "probe", Rate: 1000, Burst: 1000})
		return err == nil, fmt.Sprintf("a check after the restart: %v", err)
	})
	if n := r.logged(back) - backsBefore; n != 1 {
		t.Errorf("the recovery was logged %d times, want once", n)
	}
	// Shared again: the restarted (empty) server holds the slots of both requests still in
	// flight, put back by their replica, so another replica finds the key full.
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := other.Check(context.Background(), req)
		if err == nil && d.Allowed {
			other.Release(d.Slot)
		}
		return err == nil && !d.Allowed && d.Reason == ReasonConcurrency, fmt.Sprintf("another replica's check with two in flight after the restart: %+v, %v", d, err)
	})
	r.Release(before.Slot)
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := other.Check(context.Background(), req)
		return err == nil && d.Allowed, fmt.Sprintf("another replica's check with one in flight: %+v, %v", d, err)
	})

	// A server that accepts and answers nothing: the first check waits for it until its
	// budget ends the wait (nothing else can: onlyTheBudget); the others are answered by the
	// back-off at once.
	srv.Pause()
	for i := range 5 {
		_, err := checkEnds(t, r, Request{Key: "paused", Rate: 1000, Burst: 1000})
		if err == nil {
			t.Fatalf("check %d with Redis paused: no error", i)
		}
		if unavailable := errors.Is(err, ErrUnavailable); unavailable != (i > 0) {
			t.Errorf("check %d with Redis paused: %v; want the first to ask Redis, the others %v", i, err, ErrUnavailable)
		}
	}
	srv.Resume()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, err := r.Check(context.Background(), Request{Key: "probe", Rate: 1000, Burst: 1000})
		return err == nil, fmt.Sprintf("a check after the pause: %v", err)
	})
}

func TestSessionBindingsComeWithTheCheck(t *testing.T) {
	srv := redistest.Start(t)
	a, b := startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})
	a.Bind("session-1", "decode", "decoder-2", time.Minute)
	a.Bind("session-1", "prefill", "prefiller-0", time.Minute)
	a.Bind("session-2", "decode", "decoder-1", 300*time.Millisecond)
	req := Request{Key: "client", Rate: 1000, Burst: 1000, SessionKeys: []string{"session-1", "session-2", "session-3"}}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := b.Check(context.Background(), req)
		s1, s2 := d.Bindings["session-1"], d.Bindings["session-2"]
		return err == nil && d.Allowed && len(d.Bindings) == 2 && s1["decode"] == "decoder-2" && s1["prefill"] == "prefiller-0" && s2["decode"] == "decoder-1",
			fmt.Sprintf("bindings seen by another replica: %v, %v", d.Bindings, err)
	})
	// A binding ends at its TTL; a request with no limits still reads its sessions.
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		d, err := b.Check(context.Background(), Request{Key: "client", SessionKeys: req.SessionKeys})
		_, s2 := d.Bindings["session-2"]
		return err == nil && d.Allowed && !s2 && len(d.Bindings) == 1, fmt.Sprintf("bindings after session-2's TTL: %v, %v", d.Bindings, err)
	})
}

func TestKeysAreHashedUnderTheirPrefix(t *testing.T) {
	srv := redistest.Start(t)
	r := startReplica(t, srv.Addr(), Config{Redis: RedisConfig{KeyPrefix: "tenant-a:"}})
	if d, err := r.Check(context.Background(), Request{Key: "sk-secret", Rate: 1, Burst: 1}); err != nil || !d.Allowed {
		t.Fatalf("check: %+v, %v", d, err)
	}
	k := r.key("rate", "sk-secret")
	if !strings.HasPrefix(k, "tenant-a:rate:") || strings.Contains(k, "sk-secret") {
		t.Fatalf("rate key %q: want the prefix and a hash, never the client's key", k)
	}
	if n, err := srv.Do("EXISTS", k); err != nil || n != ":1" {
		t.Fatalf("EXISTS %s = %s, %v", k, n, err)
	}
	if n, err := srv.Do("DBSIZE"); err != nil || n != ":1" {
		t.Fatalf("DBSIZE = %s, %v; want the one rate key", n, err)
	}
}

func TestAServerThatLostTheScriptRunsItAgainInOneCall(t *testing.T) {
	srv := redistest.Start(t)
	r := startReplica(t, srv.Addr(), Config{})
	req := Request{Key: "client", Rate: 1000, Burst: 1000}
	if _, err := r.Check(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Do("SCRIPT", "FLUSH"); err != nil {
		t.Fatal(err)
	}
	if d, err := r.Check(context.Background(), req); err != nil || !d.Allowed {
		t.Fatalf("a check after SCRIPT FLUSH: %+v, %v; want EVALSHA's NOSCRIPT answered by EVAL", d, err)
	}
	if v := r.errors(opCheck); v != 0 {
		t.Errorf("check errors %v, want 0", v)
	}
}

func TestAFullQueueDropsAndCounts(t *testing.T) {
	// No Run: nothing takes from the queue.
	reg := prometheus.NewRegistry()
	s, err := New(Config{Redis: RedisConfig{Addr: "127.0.0.1:1"}}, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for range queueSize + 10 {
		s.Bind("session", "decode", "d", time.Minute)
	}
	if v := testutil.Value(t, reg, "pdproxy_shared_state_dropped_total", map[string]string{"op": opBind}); v != 10 {
		t.Fatalf("dropped bindings %v, want 10", v)
	}
}
