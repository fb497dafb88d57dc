package sim

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

func TestFirstPullFromEachPrefillerWaitsForTheNIXLHandshake_Issue46240(t *testing.T) {
	pd := startPDPair(t, func(c *Config) {
		c.NIXLHandshakeDelay = 10 * time.Second
		c.KVHeartbeatInterval = 0 // heartbeats wait for handshakes too: another test
	})
	kv := pd.p.prefill(t, "first", "hello")
	done := decodeInBackground(t, context.Background(), pd.d, "first", `{"prompt":"hello","max_tokens":1,"kv_transfer_params":`+kv+`}`)
	pd.d.waitKV(t, "decode admitted, handshaking", func(s KVStats) bool { return s.RunningRequests == 1 && s.BlocksInUse == 1 })
	if s := barrier(t, pd.p); s.HeldRequests != 1 {
		t.Fatalf("P /debug/kv = %+v during the handshake, want the hold", s)
	}
	select {
	case res := <-done:
		t.Fatalf("decode answered %d %s before the handshake ended", res.status, res.body)
	default:
	}
	pd.clock.Advance(10 * time.Second)
	if res := testutil.Recv(t, testutil.Timeout, done, "the first decode"); res.status != http.StatusOK {
		t.Fatalf("first decode: %d %s", res.status, res.body)
	}
	pd.p.waitKV(t, "P frees on the notify", allFree)

	// The handshake is done once per prefiller: the next pull does not wait.
	kv = pd.p.prefill(t, "second", "hello")
	resp := pd.d.post(t, context.Background(), "/v1/completions", `{"prompt":"hello","max_tokens":1,"kv_transfer_params":`+kv+`}`, map[string]string{"X-Request-Id": "second"})
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("second decode: %d %s", resp.StatusCode, b)
	}
	s := pd.p.waitKV(t, "P frees again", allFree)
	if s.LateEventsTotal != 1 /* the barrier's */ || s.ExpiredTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("P /debug/kv = %+v", s)
	}
}

func TestAbortDuringTheFirstHandshakeIsAnAbortDuringTheTransfer_Issue46240(t *testing.T) {
	tests := []struct {
		name string
		// script runs with P holding "r1" and D's driver started, D's decode
		// handshaking; it returns the driver's error.
		script    func(t *testing.T, p, d *scripted, run *decodeRun) error
		wantP     KVStats
		wantD     KVStats
		wantNotes int
	}{
		{
			name: "client gone: D aborts, notifies once, P frees once; the handshake's end finds nothing",
			script: func(t *testing.T, p, d *scripted, run *decodeRun) error {
				run.cancel()
				err := testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
				d.stepNow()
				d.clock.Advance(time.Minute)
				d.stepNow()
				p.stepNow()
				return err
			},
			wantP:     free(16),
			wantD:     KVStats{BlocksFree: 16, AbortedTotal: 1},
			wantNotes: 1,
		},
		{
			name: "explicit abort twice: the second is late; no pull is ordered after the handshake",
			script: func(t *testing.T, p, d *scripted, run *decodeRun) error {
				d.abortRID("r1")
				d.stepNow()
				err := testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
				d.abortRID("r1")
				d.clock.Advance(time.Minute)
				d.stepNow()
				p.stepNow()
				p.finishedSending("r1") // a duplicate notify: late on P
				p.stepNow()
				return err
			},
			wantP:     KVStats{BlocksFree: 16, LateEventsTotal: 1},
			wantD:     KVStats{BlocksFree: 16, AbortedTotal: 1, LateEventsTotal: 1},
			wantNotes: 1,
		},
		{
			name: "a handshake longer than the lease: the pull after it fails, nothing is freed twice",
			script: func(t *testing.T, p, d *scripted, run *decodeRun) error {
				p.clock.Advance(2 * time.Minute) // past P's 1-minute lease and D's handshake
				p.stepNow()                      // expiry
				d.stepNow()                      // handshake done: pull ordered
				testutil.Recv(t, testutil.Timeout, d.wake, "D's finished_receiving")
				d.stepNow()
				return testutil.Recv(t, testutil.Timeout, run.done, "the decode's end")
			},
			wantP:     KVStats{BlocksFree: 16, ExpiredTotal: 1},
			wantD:     free(16),
			wantNotes: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			p := newScripted(t, scriptedConfig(), clock)
			dc := scriptedConfig()
			dc.NIXLHandshakeDelay = 90 * time.Second
			d := newScripted(t, dc, clock)
			tr := newPeerTransport(p.Engine, false)
			d.transport = tr
			_, kv := p.holdPrefill(t, "r1")
			r := d.request(t, "r1", kindDecode, 32, 4, kv)
			run := startDecode(d, r)
			defer run.cancel()
			testutil.Recv(t, testutil.Timeout, d.wake, "D's submit")
			d.stepNow()
			if st := d.Stats(); st.RunningRequests != 1 || st.BlocksInUse != 2 || !r.handshaking {
				t.Fatalf("D stats %+v, handshaking %v: want the decode admitted and handshaking", st, r.handshaking)
			}
			err := tt.script(t, p, d, run)
			if err == nil {
				t.Errorf("decode ended without an error")
			}
			checkStats(t, "P", p.Stats(), tt.wantP)
			checkStats(t, "D", d.Stats(), tt.wantD)
			if n := len(tr.notifications()); n != tt.wantNotes {
				t.Errorf("D sent %d notifications, want %d", n, tt.wantNotes)
			}
		})
	}
}

func TestHeartbeatsWaitForTheFirstHandshake_PR41383_Issue46240(t *testing.T) {
	clock := newFakeClock()
	p := newScripted(t, leaseConfig(), clock)
	dc := leaseConfig()
	dc.NIXLHandshakeDelay = 10 * time.Second
	dc.MaxRunning = 1
	d := newScripted(t, dc, clock)
	tr := newPeerTransport(p.Engine, false)
	d.transport = tr
	_, kv := p.holdPrefill(t, "r1")
	blocker := d.request(t, "blocker", kindAggregated, 16, 1000, nil)
	_ = d.submit(blocker)
	r := d.request(t, "r1", kindDecode, 32, 4, kv)
	_ = d.submit(r)
	d.stepNow()
	if st := d.Stats(); st.WaitingRequests != 1 {
		t.Fatalf("D stats %+v, want the decode queued", st)
	}

	ctx := context.Background()
	d.sendHeartbeats(ctx) // starts the handshake, sends nothing
	clock.Advance(9 * time.Second)
	d.sendHeartbeats(ctx)
	if hb := tr.heartbeatsSent(); len(hb) != 0 {
		t.Fatalf("heartbeats %v sent before the handshake ended", hb)
	}
	clock.Advance(time.Second)
	d.sendHeartbeats(ctx)
	p.stepNow()
	if hb := tr.heartbeatsSent(); strings.Join(hb, ",") != "r1" {
		t.Fatalf("heartbeats sent %v, want [r1] once the handshake is done", hb)
	}
	checkStats(t, "P", p.Stats(), KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, HeartbeatsTotal: 1})
	if st := d.Stats(); st.HeartbeatsSentTotal != 1 {
		t.Errorf("D heartbeats_sent_total = %d, want 1", st.HeartbeatsSentTotal)
	}
	// The lease now ends 30s after the heartbeat, 40s after the prefill.
	clock.Advance(29 * time.Second)
	p.stepNow()
	checkStats(t, "P before the renewed lease ends", p.Stats(), KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, HeartbeatsTotal: 1})
	clock.Advance(time.Second)
	p.stepNow()
	checkStats(t, "P after", p.Stats(), KVStats{BlocksFree: 16, ExpiredTotal: 1, HeartbeatsTotal: 1})
}
