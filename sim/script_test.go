package sim

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// fakeClock is a Clock that moves only when a test advances it. The Clock interface wants
// a NewTimer that returns this package's Timer, hence the one method of its own.
type fakeClock struct{ *testutil.Clock }

func newFakeClock() *fakeClock {
	return &fakeClock{testutil.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))}
}

func (c *fakeClock) NewTimer(d time.Duration) Timer { return c.Clock.NewTimer(d) }

// peerTransport carries a decoder's pull and notify straight to a prefiller
// engine in the same test. With gate set, each pull first announces itself on
// pullStarted and then waits for release (or the request's end).
type peerTransport struct {
	peer        *Engine
	gate        bool
	pullStarted chan struct{}
	release     chan struct{}

	mu         sync.Mutex
	notified   []string
	heartbeats []string
}

func newPeerTransport(peer *Engine, gate bool) *peerTransport {
	return &peerTransport{peer: peer, gate: gate, pullStarted: make(chan struct{}, 1), release: make(chan struct{})}
}

func (p *peerTransport) pull(ctx context.Context, kv *kvTransferParams) error {
	if p.gate {
		p.pullStarted <- struct{}{}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.release:
		}
	}
	return p.peer.checkHeld(kv.RemoteEngineID, kv.RemoteRequestID, kv.RemoteBlockIDs)
}

func (p *peerTransport) claim(context.Context, *sglangLeg, string) (*claimResponse, error) {
	return nil, errors.New("peerTransport: no SGLang bootstrap")
}

func (p *peerTransport) claimTransfer(context.Context, *mooncakeLeg) (*claimResponse, error) {
	return nil, errors.New("script: no mooncake bootstrap server")
}

func (p *peerTransport) releaseTransfer(context.Context, *mooncakeLeg) error {
	return errors.New("script: no mooncake bootstrap server")
}

func (p *peerTransport) notify(_ context.Context, kv *kvTransferParams, _ string) error {
	p.mu.Lock()
	p.notified = append(p.notified, kv.RemoteRequestID)
	p.mu.Unlock()
	p.peer.finishedSending(kv.RemoteRequestID)
	return nil
}

func (p *peerTransport) heartbeat(_ context.Context, _ *kvTransferParams, rids []string) error {
	p.mu.Lock()
	p.heartbeats = append(p.heartbeats, rids...)
	p.mu.Unlock()
	p.peer.heartbeat(rids)
	return nil
}

func (p *peerTransport) heartbeatsSent() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.heartbeats...)
}

func (p *peerTransport) notifications() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.notified...)
}

// scripted is an engine without Run: the test steps it.
type scripted struct {
	*Engine
	clock *fakeClock
}

func scriptedConfig() Config {
	cfg := DefaultConfig()
	cfg.KVBlocks = 16
	cfg.PrefillTime = 20 * time.Millisecond
	cfg.ITL = 10 * time.Millisecond
	cfg.KVHoldTimeout = time.Minute
	return cfg
}

func newScripted(t *testing.T, cfg Config, clock *fakeClock) *scripted {
	t.Helper()
	cfg.Clock = clock
	e, err := New(cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(e.client.CloseIdleConnections)
	return &scripted{Engine: e, clock: clock}
}

// stepNow runs one step at the fake clock's time.
func (s *scripted) stepNow() { s.step(s.clock.Now()) }

// request builds an engine request of kind for a prompt of promptTokens
// tokens, decoding max tokens with ignore_eos.
func (s *scripted) request(t *testing.T, rid string, kind reqKind, promptTokens, maxTokens int, kv *kvTransferParams) *request {
	t.Helper()
	r, err := s.newRequest(rid, &apiRequest{promptTokens: promptTokens, maxTokens: maxTokens, ignoreEOS: true, kind: kind, kv: kv})
	if err != nil {
		t.Fatalf("newRequest: %v", err)
	}
	return r
}

// holdPrefill runs a prefill of rid (32 tokens: 2 blocks) to its hold and
// returns it with the kv_transfer_params a decoder would get.
func (s *scripted) holdPrefill(t *testing.T, rid string) (*request, *kvTransferParams) {
	t.Helper()
	r := s.request(t, rid, kindPrefill, 32, 1, nil)
	if err := s.submit(r); err != nil {
		t.Fatal(err)
	}
	s.stepNow()
	s.clock.Advance(s.cfg.PrefillTime)
	s.stepNow()
	outs := r.take()
	if len(outs) != 1 || outs[0].held == nil {
		t.Fatalf("prefill outputs = %+v, want one final token with a hold", outs)
	}
	kv := &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: outs[0].held, RemoteEngineID: s.id,
		RemoteRequestID: rid, RemoteHost: "127.0.0.1", RemotePort: 1, TPSize: 1}
	if st := s.Stats(); st.BlocksHeld != 2 || st.HeldRequests != 1 {
		t.Fatalf("after prefill stats = %+v, want 2 blocks held", st)
	}
	return r, kv
}

// checkStats compares the counters a test cares about and the pool invariant.
func checkStats(t *testing.T, name string, got KVStats, want KVStats) {
	t.Helper()
	if got.BlocksFree+got.BlocksInUse+got.BlocksHeld != got.BlocksTotal {
		t.Errorf("%s: free %d + in use %d + held %d != total %d", name, got.BlocksFree, got.BlocksInUse, got.BlocksHeld, got.BlocksTotal)
	}
	want.BlocksTotal = got.BlocksTotal
	// Counters of arrivals, holds and pulled blocks have tests of their own
	// (counters_test.go, prefix_test.go).
	want.KVBlocksPulledTotal = got.KVBlocksPulledTotal
	want.RequestsTotal = got.RequestsTotal
	want.HoldsTotal = got.HoldsTotal
	want.RemotePrefillRequestsTotal = got.RemotePrefillRequestsTotal
	// Priorities count arrivals too (priority_test.go).
	want.Priorities = got.Priorities
	// Ranks repeat the sums per rank (dp_test.go tests them).
	want.Ranks = got.Ranks
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s: stats = %+v\nwant %+v", name, got, want)
	}
}

func free(total int) KVStats { return KVStats{BlocksFree: total} }

func TestScriptedPrefillerRaces(t *testing.T) {
	tests := []struct {
		name string
		// script acts on a prefiller holding request "r1" (2 blocks of 16).
		script func(p *scripted, r *request)
		want   KVStats
	}{
		{
			// vLLM raised KeyError when an abort found its request already
			// finished (R1/R5); the hold must survive the client's disconnect.
			name: "abort after finish is a no-op and the hold survives (vLLM KeyError on abort of finished request)",
			script: func(p *scripted, r *request) {
				p.abortRequest(r)
				p.stepNow()
			},
			want: KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, LateEventsTotal: 1},
		},
		{
			name: "abort after finish then the decoder's notify frees the hold once",
			script: func(p *scripted, r *request) {
				p.abortRequest(r)
				p.stepNow()
				p.finishedSending("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, LateEventsTotal: 1},
		},
		{
			// vLLM's scheduler asserted `req_id in self.requests` on
			// finished_sending and crashed when the request was gone (R3).
			name: "finished_sending for an aborted request is skipped (vLLM assert req_id in self.requests crash)",
			script: func(p *scripted, r *request) {
				p.abortRID("r1")
				p.finishedSending("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, AbortedTotal: 1, LateEventsTotal: 1},
		},
		{
			name: "expiry frees the hold once and a later notify is a late event",
			script: func(p *scripted, r *request) {
				p.clock.Advance(time.Minute)
				p.stepNow()
				p.stepNow()
				p.finishedSending("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, ExpiredTotal: 1, LateEventsTotal: 1},
		},
		{
			name: "notify arriving in the step where the hold expires frees once, as a read",
			script: func(p *scripted, r *request) {
				p.clock.Advance(time.Minute)
				p.finishedSending("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16},
		},
		{
			name: "notify just before expiry frees and the expiry finds nothing",
			script: func(p *scripted, r *request) {
				p.clock.Advance(time.Minute - time.Nanosecond)
				p.finishedSending("r1")
				p.stepNow()
				p.clock.Advance(time.Hour)
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16},
		},
		{
			name: "duplicate notify frees once, the second is late",
			script: func(p *scripted, r *request) {
				p.finishedSending("r1")
				p.finishedSending("r1")
				p.stepNow()
				p.finishedSending("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, LateEventsTotal: 2},
		},
		{
			name: "explicit abort of a held request twice frees once",
			script: func(p *scripted, r *request) {
				p.abortRID("r1")
				p.stepNow()
				p.abortRID("r1")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, AbortedTotal: 1, LateEventsTotal: 1},
		},
		{
			name: "abort of an unknown request id is a counted no-op",
			script: func(p *scripted, r *request) {
				p.abortRID("nobody")
				p.finishedSending("nobody")
				p.stepNow()
			},
			want: KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, LateEventsTotal: 2},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newScripted(t, scriptedConfig(), newFakeClock())
			r, _ := p.holdPrefill(t, "r1")
			tt.script(p, r)
			checkStats(t, tt.name, p.Stats(), tt.want)
		})
	}
}

func TestScriptedLiveRequestRaces(t *testing.T) {
	tests := []struct {
		name   string
		script func(t *testing.T, e *scripted, r *request)
		want   KVStats
		end    error // what r's last output says
	}{
		{
			name: "double abort of a decoding request frees once",
			script: func(t *testing.T, e *scripted, r *request) {
				e.abortRequest(r)
				e.abortRequest(r)
				e.abortRID(r.rid)
				e.stepNow()
				e.abortRequest(r)
				e.stepNow()
			},
			want: KVStats{BlocksFree: 16, AbortedTotal: 1, LateEventsTotal: 3},
			end:  errAborted,
		},
		{
			name: "abort arriving after the last token is a no-op",
			script: func(t *testing.T, e *scripted, r *request) {
				for range 3 {
					e.clock.Advance(e.cfg.ITL)
					e.stepNow()
				}
				e.abortRequest(r)
				e.stepNow()
			},
			want: KVStats{BlocksFree: 16, LateEventsTotal: 1},
		},
		{
			name: "abort of a waiting request removes it from the queue",
			script: func(t *testing.T, e *scripted, r *request) {
				w := e.request(t, "waiter", kindAggregated, 16*16, 4, nil) // the whole pool: must wait
				_ = e.submit(w)
				e.stepNow()
				if st := e.Stats(); st.WaitingRequests != 1 {
					t.Fatalf("waiter is not waiting: %+v", st)
				}
				e.abortRequest(w)
				e.abortRequest(r)
				e.stepNow()
			},
			want: KVStats{BlocksFree: 16, AbortedTotal: 2},
			end:  errAborted,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newScripted(t, scriptedConfig(), newFakeClock())
			r := e.request(t, "live", kindAggregated, 20, 4, nil)
			if err := e.submit(r); err != nil {
				t.Fatal(err)
			}
			e.stepNow()
			e.clock.Advance(e.cfg.PrefillTime)
			e.stepNow() // first token
			tt.script(t, e, r)
			checkStats(t, tt.name, e.Stats(), tt.want)
			outs := r.take()
			last := outs[len(outs)-1]
			if tt.end != nil && !errors.Is(last.err, tt.end) {
				t.Errorf("last output = %+v, want end with %v", last, tt.end)
			}
			if tt.end == nil && last.finish != "length" {
				t.Errorf("last output = %+v, want finish length", last)
			}
		})
	}
}

func TestScriptedDecoderFinishedReceivingAfterAbortIsLate(t *testing.T) {
	d := newScripted(t, scriptedConfig(), newFakeClock())
	r := d.request(t, "r1", kindDecode, 32, 4, &kvTransferParams{DoRemotePrefill: true, RemoteBlockIDs: []int{0, 1}, RemoteHost: "127.0.0.1", RemotePort: 1})
	_ = d.submit(r)
	d.stepNow()
	if outs := r.take(); len(outs) != 1 || outs[0].kind != outPull {
		t.Fatalf("decode outputs = %+v, want a pull order", outs)
	}
	d.abortRID("r1")
	d.finishedReceiving(r, nil)
	d.stepNow()
	for range 5 {
		d.clock.Advance(d.cfg.ITL)
		d.stepNow()
	}
	checkStats(t, "decoder", d.Stats(), KVStats{BlocksFree: 16, AbortedTotal: 1, LateEventsTotal: 1})
}

// decodeRun drives a decode on d in a goroutine, as its HTTP handler would.
type decodeRun struct {
	cancel context.CancelFunc
	done   chan error
}

func startDecode(d *scripted, r *request) *decodeRun {
	ctx, cancel := context.WithCancel(context.Background())
	run := &decodeRun{cancel: cancel, done: make(chan error, 1)}
	go func() { run.done <- d.drive(ctx, r, func(output) error { return nil }) }()
	return run
}

func TestScriptedDecoderRaces(t *testing.T) {
	tests := []struct {
		name string
		// script runs with P holding "r1" and D's driver started; it returns
		// the driver's error.
		script    func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error
		wantP     KVStats
		wantD     KVStats
		wantNotes int
		wantErr   func(error) bool
	}{
		{
			name: "decode pulls, notifies the prefiller, then generates",
			script: func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error {
				testutil.Recv(t, testutil.Timeout, d.wake, "D's event")
				d.stepNow() // admitted: pull order
				testutil.Recv(t, testutil.Timeout, tr.pullStarted, "the pull")
				send(t, tr.release)
				testutil.Recv(t, testutil.Timeout, d.wake, "D's finished_receiving")
				for range 4 {
					d.stepNow()
					d.clock.Advance(d.cfg.ITL)
				}
				p.stepNow()
				return testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
			},
			wantP:     free(16),
			wantD:     free(16),
			wantNotes: 1,
			wantErr:   func(err error) bool { return err == nil },
		},
		{
			name: "abort before the pull still notifies the prefiller, which frees",
			script: func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error {
				testutil.Recv(t, testutil.Timeout, d.wake, "D's submit") // submitted, not yet scheduled
				run.cancel()
				err := testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
				d.stepNow()
				p.stepNow()
				return err
			},
			wantP:     free(16),
			wantD:     KVStats{BlocksFree: 16, AbortedTotal: 1},
			wantNotes: 1,
			wantErr:   func(err error) bool { return errors.Is(err, context.Canceled) },
		},
		{
			name: "abort during the pull notifies the prefiller and frees both sides",
			script: func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error {
				testutil.Recv(t, testutil.Timeout, d.wake, "D's event")
				d.stepNow()
				testutil.Recv(t, testutil.Timeout, tr.pullStarted, "the pull")
				if st := d.Stats(); st.BlocksInUse != 2 || st.RunningRequests != 1 {
					t.Errorf("during pull D stats = %+v, want 2 blocks in use by 1 running request", st)
				}
				run.cancel()
				err := testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
				d.stepNow()
				p.stepNow()
				return err
			},
			wantP:     free(16),
			wantD:     KVStats{BlocksFree: 16, AbortedTotal: 1},
			wantNotes: 1,
			wantErr:   func(err error) bool { return errors.Is(err, context.Canceled) },
		},
		{
			// Race R4: P's timer fired before D read. The read must fail
			// loudly instead of decoding from reused blocks.
			name: "pull after the hold expired fails the decode with a 500, not a 200",
			script: func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error {
				p.clock.Advance(time.Minute)
				p.stepNow() // expiry
				testutil.Recv(t, testutil.Timeout, d.wake, "D's event")
				d.stepNow()
				testutil.Recv(t, testutil.Timeout, tr.pullStarted, "the pull")
				send(t, tr.release)
				testutil.Recv(t, testutil.Timeout, d.wake, "D's finished_receiving") // with the error
				d.stepNow()
				return testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
			},
			wantP:     KVStats{BlocksFree: 16, ExpiredTotal: 1},
			wantD:     free(16),
			wantNotes: 0, // P said it holds nothing: no notify to send
			wantErr: func(err error) bool {
				var ae *apiError
				return errors.As(err, &ae) && ae.Status == http.StatusInternalServerError && ae.Code == "kv_transfer_failed"
			},
		},
		{
			name: "hold expiring during the pull fails the decode and the late notify-free path stays clean",
			script: func(t *testing.T, p, d *scripted, tr *peerTransport, run *decodeRun) error {
				testutil.Recv(t, testutil.Timeout, d.wake, "D's event")
				d.stepNow()
				testutil.Recv(t, testutil.Timeout, tr.pullStarted, "the pull")
				p.clock.Advance(time.Minute)
				p.stepNow() // expiry while the read is in flight
				send(t, tr.release)
				testutil.Recv(t, testutil.Timeout, d.wake, "D's event")
				d.stepNow()
				return testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
			},
			wantP:     KVStats{BlocksFree: 16, ExpiredTotal: 1},
			wantD:     free(16),
			wantNotes: 0,
			wantErr: func(err error) bool {
				var ae *apiError
				return errors.As(err, &ae) && ae.Status == http.StatusInternalServerError
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			p := newScripted(t, scriptedConfig(), clock)
			d := newScripted(t, scriptedConfig(), clock)
			tr := newPeerTransport(p.Engine, true)
			d.transport = tr
			_, kv := p.holdPrefill(t, "r1")
			r := d.request(t, "r1", kindDecode, 32, 4, kv)
			run := startDecode(d, r)
			defer run.cancel()
			err := tt.script(t, p, d, tr, run)
			if !tt.wantErr(err) {
				t.Errorf("decode ended with %v", err)
			}
			checkStats(t, "P", p.Stats(), tt.wantP)
			checkStats(t, "D", d.Stats(), tt.wantD)
			if n := len(tr.notifications()); n != tt.wantNotes {
				t.Errorf("decoder sent %d notifications, want %d", n, tt.wantNotes)
			}
		})
	}
}

// send bounds a test's wait for a receiver, so that a broken guard fails the test instead
// of hanging it.
func send(t *testing.T, ch chan<- struct{}) {
	t.Helper()
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case ch <- struct{}{}:
	case <-timer.C:
		t.Fatal("timed out: nobody received")
	}
}
