package router

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

type acquired struct {
	lease *Lease
	err   error
}

// acquireAsync starts an Acquire and waits until it is queued, so tests control the
// queue order.
func acquireAsync(t *testing.T, r *Router, ctx context.Context, h Hint) <-chan acquired {
	t.Helper()
	before := queued(r, routerconfig.RoleDecode)
	ch := make(chan acquired, 1)
	go func() {
		l, err := r.Acquire(ctx, routerconfig.RoleDecode, h)
		ch <- acquired{l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == before+1 }, "the request to queue")
	return ch
}

func TestQueueReleaseWakesWaitersInOrder(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	first := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	w1 := acquireAsync(t, r, context.Background(), Hint{RequestID: "w1"})
	w2 := acquireAsync(t, r, context.Background(), Hint{RequestID: "w2"})

	first.Release(Result{Status: 200})
	a1 := testutil.Recv(t, testutil.Timeout, w1, "Acquire to return")
	if a1.err != nil {
		t.Fatalf("first waiter: %v", a1.err)
	}
	select {
	case a := <-w2:
		t.Fatalf("second waiter served before its turn: %+v", a)
	default:
	}
	if n := a1.lease.Backend().Inflight(); n != 1 {
		t.Errorf("inflight after hand-over = %d, want 1", n)
	}
	a1.lease.Release(Result{Status: 200})
	a2 := testutil.Recv(t, testutil.Timeout, w2, "Acquire to return")
	if a2.err != nil {
		t.Fatalf("second waiter: %v", a2.err)
	}
	a2.lease.Release(Result{Status: 200})
	assertAllIdle(t, r)
	if n, _ := testutil.Lookup(t, reg, "pdproxy_queue_wait_seconds", map[string]string{"role": "decode"}); n != 2 {
		t.Errorf("queue_wait_seconds count = %v, want 2", n)
	}
}

func TestQueueOutcomes(t *testing.T) {
	tests := []struct {
		name    string
		queue   routerconfig.QueueConfig
		waiting int // waiters queued before the one under test
		ctx     func() (context.Context, context.CancelFunc)
		want    error
	}{
		{"full queue rejects at once", routerconfig.QueueConfig{Size: 1, Timeout: time.Minute}, 1, nil, ErrQueueFull},
		{"negative size never queues", routerconfig.QueueConfig{Size: -1, Timeout: time.Minute}, 0, nil, ErrQueueFull},
		{"long wait times out", routerconfig.QueueConfig{Size: 4, Timeout: 20 * time.Millisecond}, 0, nil, ErrQueueTimeout},
		{"client deadline ends the wait", routerconfig.QueueConfig{Size: 4, Timeout: time.Minute}, 0, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 20*time.Millisecond)
		}, context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: tt.queue})
			busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
			bg, cancelBg := context.WithCancel(context.Background())
			var others []<-chan acquired
			for range tt.waiting {
				others = append(others, acquireAsync(t, r, bg, Hint{}))
			}
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if tt.ctx != nil {
				ctx, cancel = tt.ctx()
			}
			defer cancel()
			l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{})
			if !errors.Is(err, tt.want) || l != nil {
				t.Fatalf("Acquire = %v, %v; want %v", l, err, tt.want)
			}
			cancelBg()
			for _, o := range others {
				if a := testutil.Recv(t, testutil.Timeout, o, "Acquire to return"); !errors.Is(a.err, context.Canceled) {
					t.Errorf("canceled waiter got %+v", a)
				}
			}
			if n := queued(r, routerconfig.RoleDecode); n != 0 {
				t.Errorf("%d waiters left in the queue", n)
			}
			busy.Release(Result{Status: 200})
			assertAllIdle(t, r)
			if v, _ := testutil.Lookup(t, reg, "pdproxy_queue_waiting_requests", map[string]string{"role": "decode"}); v != 0 {
				t.Errorf("queue_waiting_requests = %v, want 0", v)
			}
		})
	}
}

func TestQueueCanceledWaiterLeavesAtOnceAndTakesNoSlot(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	ctx, cancel := context.WithCancel(context.Background())
	gone := acquireAsync(t, r, ctx, Hint{RequestID: "gone"})
	stays := acquireAsync(t, r, context.Background(), Hint{RequestID: "stays"})
	cancel()
	if a := testutil.Recv(t, testutil.Timeout, gone, "Acquire to return"); !errors.Is(a.err, context.Canceled) {
		t.Fatalf("canceled waiter got %+v, want context.Canceled", a)
	}
	if n := queued(r, routerconfig.RoleDecode); n != 1 {
		t.Fatalf("queue length after cancel = %d, want 1", n)
	}
	busy.Release(Result{Status: 200})
	a := testutil.Recv(t, testutil.Timeout, stays, "Acquire to return")
	if a.err != nil {
		t.Fatalf("remaining waiter: %v", a.err)
	}
	a.lease.Release(Result{Status: 200})
	assertAllIdle(t, r)
}

func TestQueueExcludingWaiterDoesNotBlockOthers(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 1)})
	l0 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
	l1 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d0"}})
	picky := acquireAsync(t, r, context.Background(), Hint{Exclude: []string{"d0"}})
	other := acquireAsync(t, r, context.Background(), Hint{})
	l0.Release(Result{Status: 200}) // frees d0, which picky refuses
	a := testutil.Recv(t, testutil.Timeout, other, "Acquire to return")
	if a.err != nil || a.lease.Backend().Name != "d0" {
		t.Fatalf("other waiter got %+v, want d0", a)
	}
	l1.Release(Result{Status: 200})
	p := testutil.Recv(t, testutil.Timeout, picky, "Acquire to return")
	if p.err != nil || p.lease.Backend().Name != "d1" {
		t.Fatalf("picky waiter got %+v, want d1", p)
	}
	a.lease.Release(Result{})
	p.lease.Release(Result{})
	assertAllIdle(t, r)
}

func TestQueueWaiterGetsErrNoBackendWhenPoolGoesDown(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	w := acquireAsync(t, r, context.Background(), Hint{})
	backendByName(t, r, "d0").st.up.Store(false)
	r.decode.kick() // what a health round does after a verdict
	if a := testutil.Recv(t, testutil.Timeout, w, "Acquire to return"); !errors.Is(a.err, ErrNoBackend) {
		t.Fatalf("waiter got %+v, want ErrNoBackend", a)
	}
	busy.Release(Result{Status: 200})
	assertAllIdle(t, r)
}

func TestQueueWaiterServedByBackendAddedOnReload(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)}
	r, _, _ := newTestRouter(t, cfg)
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	w := acquireAsync(t, r, context.Background(), Hint{})
	cfg.Backends = backendsCfg(routerconfig.RoleDecode, "d", 2, 1)
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	a := testutil.Recv(t, testutil.Timeout, w, "Acquire to return")
	if a.err != nil || a.lease.Backend().Name != "d1" {
		t.Fatalf("waiter got %+v, want the new d1", a)
	}
	a.lease.Release(Result{})
	busy.Release(Result{})
	assertAllIdle(t, r)
}

// serveInTurn releases busy and then each lease the waiters get, one at a time on the one
// backend, and returns the waiters' names in the order they were served.
func serveInTurn(t *testing.T, busy *Lease, waiters map[string]<-chan acquired) []string {
	t.Helper()
	var order []string
	held := busy
	for len(order) < len(waiters) {
		held.Release(Result{Status: 200})
		held = nil
		// Exactly one waiter gets the freed slot; find which.
		testutil.Eventually(t, testutil.Timeout, func() bool {
			for name, ch := range waiters {
				if slices.Contains(order, name) {
					continue
				}
				select {
				case a := <-ch:
					if a.err != nil {
						t.Fatalf("waiter %s: %v", name, a.err)
					}
					order = append(order, name)
					held = a.lease
					return true
				default:
				}
			}
			return false
		}, "a waiter to be served")
	}
	held.Release(Result{Status: 200})
	return order
}

func TestQueueServesTheEarliestDeadlineFirst(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	batch := Hint{Class: "batch", Slack: time.Hour}
	waiters := map[string]<-chan acquired{}
	for _, name := range []string{"b1", "b2", "b3"} {
		batch.RequestID = name
		waiters[name] = acquireAsync(t, r, context.Background(), batch)
	}
	waiters["i1"] = acquireAsync(t, r, context.Background(), Hint{RequestID: "i1", Class: "interactive"})
	batch.RequestID = "b4"
	waiters["b4"] = acquireAsync(t, r, context.Background(), batch)
	waiters["i2"] = acquireAsync(t, r, context.Background(), Hint{RequestID: "i2", Class: "interactive"})

	order := serveInTurn(t, busy, waiters)
	if want := []string{"i1", "i2", "b1", "b2", "b3", "b4"}; !slices.Equal(order, want) {
		t.Errorf("served %v, want %v: interactive first, each class in arrival order", order, want)
	}
	assertAllIdle(t, r)
	for class, n := range map[string]float64{"batch": 4, "interactive": 2} {
		if got, _ := testutil.Lookup(t, reg, "pdproxy_queue_wait_seconds", map[string]string{"role": "decode", "class": class}); got != n {
			t.Errorf("queue_wait_seconds{class=%q} count = %v, want %v", class, got, n)
		}
	}
}

func TestQueueBatchWaiterPastItsSlackIsNotOvertaken(t *testing.T) {
	r, _, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	const slack = 20 * time.Millisecond
	waiters := map[string]<-chan acquired{}
	waiters["batch"] = acquireAsync(t, r, context.Background(), Hint{RequestID: "batch", Class: "batch", Slack: slack})
	testutil.Eventually(t, testutil.Timeout, func() bool { r.decode.mu.Lock(); defer r.decode.mu.Unlock(); return r.decode.waiters.Len() == 1 }, "batch queued")
	// Arriving after the batch waiter's deadline, interactive requests queue behind it.
	clk.Advance(3 * slack)
	waiters["i1"] = acquireAsync(t, r, context.Background(), Hint{RequestID: "i1", Class: "interactive"})
	waiters["i2"] = acquireAsync(t, r, context.Background(), Hint{RequestID: "i2", Class: "interactive"})

	order := serveInTurn(t, busy, waiters)
	if want := []string{"batch", "i1", "i2"}; !slices.Equal(order, want) {
		t.Errorf("served %v, want %v: a waiter past its deadline goes first", order, want)
	}
	assertAllIdle(t, r)
}

func TestQueueExcludingWaiterOfAnEarlierDeadlineDoesNotBlockLaterOnes(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 1)})
	l0 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
	l1 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d0"}})
	batch := acquireAsync(t, r, context.Background(), Hint{Class: "batch", Slack: time.Hour})
	picky := acquireAsync(t, r, context.Background(), Hint{Class: "interactive", Exclude: []string{"d0"}})
	l0.Release(Result{Status: 200}) // frees d0, which the interactive waiter refuses
	a := testutil.Recv(t, testutil.Timeout, batch, "the batch waiter to be served")
	if a.err != nil || a.lease.Backend().Name != "d0" {
		t.Fatalf("batch waiter got %+v, want d0", a)
	}
	l1.Release(Result{Status: 200})
	p := testutil.Recv(t, testutil.Timeout, picky, "the picky waiter to be served")
	if p.err != nil || p.lease.Backend().Name != "d1" {
		t.Fatalf("picky waiter got %+v, want d1", p)
	}
	a.lease.Release(Result{})
	p.lease.Release(Result{})
	assertAllIdle(t, r)
}
