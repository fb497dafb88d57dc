package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// liveStateBody is GET /debug/ui/state as the page reads it: by its JSON names, so that a
// renamed field fails here as it would break the page.
type liveStateBody struct {
	Time            time.Time      `json:"time"`
	Draining        *bool          `json:"draining"`
	RequestsByState map[string]int `json:"requests_by_state"`
	RequestsTotal   *int           `json:"requests_total"`
	Requests        []struct {
		ID                      string   `json:"id"`
		State                   string   `json:"state"`
		Prefill                 string   `json:"prefill"`
		Decode                  string   `json:"decode"`
		KVHeld                  bool     `json:"kv_held"`
		KVHoldAgeSeconds        *float64 `json:"kv_hold_age_seconds"`
		KVHoldDeadlineInSeconds *float64 `json:"kv_hold_deadline_in_seconds"`
		Attempts                int      `json:"attempts"`
	} `json:"requests"`
	MigratedInFlight *int `json:"migrated_in_flight"`
	Migrations       struct {
		ByReason       map[string]map[string]int64 `json:"by_reason"`
		Refused        map[string]int64            `json:"refused"`
		TokensReplayed *int64                      `json:"tokens_replayed"`
	} `json:"migrations"`
	KVHolds []struct {
		Prefill string `json:"prefill"`
		Count   int    `json:"count"`
		Holds   []struct {
			ID                string   `json:"id"`
			State             string   `json:"state"`
			AgeSeconds        *float64 `json:"age_seconds"`
			DeadlineInSeconds *float64 `json:"deadline_in_seconds"`
		} `json:"holds"`
	} `json:"kv_holds"`
	RecentAborts []struct {
		ID                 string    `json:"id"`
		EngineRequestID    string    `json:"engine_request_id"`
		Route              string    `json:"route"`
		Stage              string    `json:"stage"`
		Action             string    `json:"action"`
		Prefill            string    `json:"prefill"`
		Decode             string    `json:"decode"`
		At                 time.Time `json:"at"`
		PropagationSeconds *float64  `json:"propagation_seconds"`
	} `json:"recent_aborts"`
	Backends []struct {
		Name        string `json:"name"`
		Role        string `json:"role"`
		Healthy     bool   `json:"healthy"`
		Inflight    *int64 `json:"inflight"`
		MaxInflight int    `json:"max_inflight"`
		Engine      string `json:"engine"`
	} `json:"backends"`
}

func (h *harness) liveState(hdr http.Header) liveStateBody {
	h.t.Helper()
	resp, body := h.do(http.MethodGet, "/debug/ui/state", "", hdr)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
		h.t.Fatalf("/debug/ui/state = %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
	}
	var st liveStateBody
	if err := json.Unmarshal(body, &st); err != nil {
		h.t.Fatalf("/debug/ui/state is not the state: %v: %s", err, body)
	}
	if st.Requests == nil || st.KVHolds == nil || st.RecentAborts == nil || st.Backends == nil || st.RequestsTotal == nil || st.Draining == nil ||
		st.MigratedInFlight == nil || st.Migrations.ByReason == nil || st.Migrations.Refused == nil || st.Migrations.TokensReplayed == nil {
		h.t.Fatalf("/debug/ui/state lacks a list or a field the page reads (an empty list must be []): %s", body)
	}
	return st
}

// TestLiveViewPageIsSelfContained checks what a browser gets at /debug/ui: one HTML page that
// loads nothing from anywhere (no script, style, image or font by URL), that may call only
// back to the proxy, and that reads its state from beside itself.
func TestLiveViewPageIsSelfContained(t *testing.T) {
	h := aggregated(t, Config{}, newEngine(t, vllmDecode))
	resp, body := h.do(http.MethodGet, "/debug/ui", "", nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/debug/ui = %d", resp.StatusCode)
	}
	page := string(body)
	for _, tc := range []struct{ name, got, want string }{
		{"the page is HTML", resp.Header.Get("Content-Type"), "text/html; charset=utf-8"},
		{"it is never cached (it is the proxy's own build)", resp.Header.Get("Cache-Control"), "no-store"},
		{"its policy forbids every outside load", resp.Header.Get("Content-Security-Policy"),
			"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Errorf("got %q, want %q", tc.got, tc.want)
			}
		})
	}
	t.Run("no asset is loaded by URL", func(t *testing.T) {
		if m := regexp.MustCompile(`(?i)(src|href)\s*=|@import|url\(|https?://`).FindString(page); m != "" {
			t.Errorf("the page refers to something outside itself: %q", m)
		}
	})
	t.Run("it polls the state beside it", func(t *testing.T) {
		if !strings.Contains(page, `"/state"`) || !strings.Contains(page, "setTimeout(poll, POLL_MS)") {
			t.Errorf("the page does not poll its state")
		}
	})
	t.Run("client text goes into the page as text", func(t *testing.T) {
		if strings.Contains(page, "innerHTML") || strings.Contains(page, "insertAdjacentHTML") {
			t.Errorf("the page writes markup: a request id (the client's X-Request-Id) could inject script")
		}
	})
}

// TestLiveStateFollowsARequestFromHoldToAbort drives the state the page is built from: an idle
// proxy, a stream decoding, a request whose KV the prefiller holds while it waits for the
// decoder (after_prefill, one decoder slot), then both clients leaving. Each step shows what
// an operator needs: counts by state, ids, engines, the hold with its age and deadline under
// its prefiller, and each abort with its stage, action and propagation time.
func TestLiveStateFollowsARequestFromHoldToAbort(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if d.wait(r, release) {
			vllmDecode(w, r, body)
		}
	})
	p := newEngine(t, vllmPrefill(prefillerParams))
	dcfg := decoder("d0", d.URL())
	dcfg.MaxInflight = 1
	h := newHarness(t, Config{DecoderReservation: ReserveAfterPrefill, KVRelease: ReleaseWait},
		routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p.URL()), dcfg}, Queue: routerconfig.QueueConfig{Timeout: testDeadline}})

	t.Run("idle: every state counted at zero, each prefiller listed with no hold", func(t *testing.T) {
		st := h.liveState(nil)
		if len(st.RequestsByState) != 7 {
			t.Errorf("requests_by_state = %v, want all seven states", st.RequestsByState)
		}
		for s, n := range st.RequestsByState {
			if n != 0 {
				t.Errorf("requests_by_state[%s] = %d when idle", s, n)
			}
		}
		if len(st.KVHolds) != 1 || st.KVHolds[0].Prefill != "p0" || st.KVHolds[0].Count != 0 || st.KVHolds[0].Holds == nil {
			t.Errorf("kv_holds = %+v, want p0 holding nothing", st.KVHolds)
		}
		if len(st.Backends) != 2 || st.Backends[0].Name != "p0" || st.Backends[1].Name != "d0" || st.Backends[1].MaxInflight != 1 {
			t.Errorf("backends = %+v, want p0 and d0 (max_inflight 1)", st.Backends)
		}
		if time.Since(st.Time) > testDeadline || st.Time.After(time.Now()) {
			t.Errorf("time = %v, not the proxy's now", st.Time)
		}
	})

	client := func(id string) (cancel func(), done <-chan struct{}) {
		ctx, cancelCtx := context.WithCancel(context.Background())
		ch := make(chan struct{})
		go func() {
			defer close(ch)
			req := h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","stream":true}`, http.Header{"X-Request-Id": {id}})
			if resp, err := h.front.Client().Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
		return cancelCtx, ch
	}
	waitState := func(what string, cond func(liveStateBody) bool) liveStateBody {
		t.Helper()
		var st liveStateBody
		testutil.WaitFor(t, testDeadline, func() (bool, string) {
			st = h.liveState(nil)
			return cond(st), fmt.Sprintf("%s; state: %+v", what, st)
		})
		return st
	}

	cancelA, doneA := client("stream-a")
	defer cancelA()
	waitState("stream-a decoding on d0", func(st liveStateBody) bool { return st.RequestsByState["decoding"] == 1 })
	cancelB, doneB := client("held-b")
	defer cancelB()
	st := waitState("held-b holding KV on p0", func(st liveStateBody) bool { return st.RequestsByState["kv_held"] == 1 })

	t.Run("a stream decoding and a request waiting in kv_held show by id, state and engines", func(t *testing.T) {
		if st.RequestsByState["decoding"] != 1 || *st.RequestsTotal != 2 || len(st.Requests) != 2 {
			t.Fatalf("by state %v, total %d, %d rows; want one decoding, one kv_held", st.RequestsByState, *st.RequestsTotal, len(st.Requests))
		}
		a, b := st.Requests[0], st.Requests[1]
		if a.ID != "stream-a" || a.State != "decoding" || a.Prefill != "p0" || a.Decode != "d0" || a.KVHeld {
			t.Errorf("oldest row %+v, want stream-a decoding p0 -> d0, holding nothing", a)
		}
		if b.ID != "held-b" || b.State != "kv_held" || b.Prefill != "p0" || !b.KVHeld || b.KVHoldAgeSeconds == nil || b.KVHoldDeadlineInSeconds == nil {
			t.Errorf("second row %+v, want held-b in kv_held on p0 with a hold age and deadline", b)
		}
	})
	t.Run("the hold is listed under its prefiller with its age and time left", func(t *testing.T) {
		g := st.KVHolds[0]
		if g.Prefill != "p0" || g.Count != 1 || len(g.Holds) != 1 {
			t.Fatalf("kv_holds = %+v, want one hold on p0", st.KVHolds)
		}
		hd := g.Holds[0]
		holdTimeout := h.table.KVHoldTimeout().Seconds()
		if hd.ID != "held-b" || hd.State != "kv_held" || hd.AgeSeconds == nil || *hd.AgeSeconds < 0 || *hd.AgeSeconds > testDeadline.Seconds() {
			t.Errorf("hold %+v, want held-b in kv_held, held for a moment", hd)
		}
		if hd.DeadlineInSeconds == nil || *hd.DeadlineInSeconds <= 0 || *hd.DeadlineInSeconds > holdTimeout {
			t.Errorf("deadline_in_seconds %v, want within the hold timeout (%vs)", hd.DeadlineInSeconds, holdTimeout)
		}
	})
	t.Run("the engines show what is in flight on them", func(t *testing.T) {
		for _, b := range st.Backends {
			if b.Name == "d0" && (b.Inflight == nil || *b.Inflight != 1 || !b.Healthy || b.Role != "decode") {
				t.Errorf("d0 = %+v, want healthy with the stream in flight", b)
			}
		}
	})

	cancelB()
	<-doneB
	st = waitState("held-b gone, its hold with it", func(st liveStateBody) bool {
		return len(st.Requests) == 1 && st.KVHolds[0].Count == 0 && len(st.RecentAborts) == 1
	})
	t.Run("a client leaving in kv_held: its hold goes, its abort is listed with stage and action", func(t *testing.T) {
		ab := st.RecentAborts[0]
		if ab.ID != "held-b" || ab.Stage != "kv_held" || ab.Action != "release_kv" || ab.Prefill != "p0" || ab.Route != "/v1/completions" {
			t.Errorf("abort %+v, want held-b in kv_held, release_kv, on p0", ab)
		}
		if ab.EngineRequestID == "" || ab.EngineRequestID == ab.ID {
			t.Errorf("engine_request_id %q: want the engines' own id, not the client's", ab.EngineRequestID)
		}
		if ab.PropagationSeconds == nil || *ab.PropagationSeconds < 0 || *ab.PropagationSeconds > testDeadline.Seconds() {
			t.Errorf("propagation_seconds %v", ab.PropagationSeconds)
		}
		if ab.At.After(st.Time) || st.Time.Sub(ab.At) > testDeadline {
			t.Errorf("at %v, state time %v: want the moment the client left", ab.At, st.Time)
		}
	})

	cancelA()
	<-doneA
	st = waitState("stream-a gone", func(st liveStateBody) bool { return len(st.Requests) == 0 && len(st.RecentAborts) == 2 })
	t.Run("aborts are listed newest first, a decode's with its decoder", func(t *testing.T) {
		ab := st.RecentAborts[0]
		if ab.ID != "stream-a" || ab.Stage != "decoding" || ab.Action != "cancel_decode" || ab.Decode != "d0" {
			t.Errorf("newest abort %+v, want stream-a, decoding, cancel_decode on d0", ab)
		}
		if st.RecentAborts[1].ID != "held-b" {
			t.Errorf("second abort %+v, want held-b", st.RecentAborts[1])
		}
	})
	h.waitQuiet()
}

// TestLiveStateShowsAStreamThatMoved drives the state through a real migration: two greedy
// decoders that die after 3 tokens, whose continuations (prompts of ids) wait to be let go. A
// stream whose decoder died shows, while its continuation waits, as a row with its attempt,
// counted in migrated_in_flight, and the totals count its move and the tokens it replayed; a
// stream that cannot move (logprobs) counts as not_migratable, by why. The totals are those
// /metrics serves, and they stay once the moved stream has ended.
func TestLiveStateShowsAStreamThatMoved(t *testing.T) {
	release := make(chan struct{})
	var ds [2]*fakeEngine
	for i := range ds {
		ds[i] = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
			if strings.Contains(string(body), `"prompt":[`) && !ds[i].wait(r, release) {
				return
			}
			greedy{dieAfter: 3}.handler()(w, r, body)
		})
	}
	h := aggregated(t, Config{MigrationLimit: 2}, ds[0], ds[1])

	st := h.liveState(nil)
	t.Run("idle: nothing moved, every reason and outcome counted at zero", func(t *testing.T) {
		if *st.MigratedInFlight != 0 || *st.Migrations.TokensReplayed != 0 || len(st.Migrations.Refused) != 0 {
			t.Errorf("migrated_in_flight %d, tokens_replayed %d, refused %v; want nothing", *st.MigratedInFlight, *st.Migrations.TokensReplayed, st.Migrations.Refused)
		}
		for _, reason := range []string{"decoder_failed", "idle_timeout", "error_event", "drained"} {
			for _, outcome := range []string{"migrated", "not_migratable", "limit_reached"} {
				if v, ok := st.Migrations.ByReason[reason][outcome]; !ok || v != 0 {
					t.Errorf("by_reason[%s][%s] = %v (present %v), want 0", reason, outcome, v, ok)
				}
			}
		}
		if got := len(st.Migrations.ByReason); got != 4 {
			t.Errorf("by_reason has %d reasons, want 4", got)
		}
	})

	type read struct {
		s   streamed
		err error
	}
	stream := func(id, body string) <-chan read {
		ch := make(chan read, 1)
		go func() {
			resp, err := h.front.Client().Do(h.request(context.Background(), http.MethodPost, "/v1/completions", body, http.Header{"X-Request-Id": {id}}))
			if err != nil {
				ch <- read{err: err}
				return
			}
			defer resp.Body.Close()
			ch <- read{s: readStream(t, resp.Body)}
		}()
		return ch
	}
	refused := stream("unmovable", `{"model":"m","prompt":"a","max_tokens":8,"stream":true,"logprobs":1}`)
	if r := <-refused; r.err != nil || r.s.done {
		t.Fatalf("the stream with logprobs: %v, [DONE] %v; want it failed by its decoder\n%s", r.err, r.s.done, r.s.raw)
	}
	moved := stream("moved", `{"model":"m","prompt":"hello there","max_tokens":8,"stream":true,"temperature":0}`)
	testutil.WaitFor(t, testDeadline, func() (bool, string) {
		st = h.liveState(nil)
		// Between its move (the table's Continue) and its continuation's decode, the stream is
		// received again for a moment: the row is read once the continuation decodes.
		return len(st.Requests) == 1 && st.Requests[0].Attempts == 1 && st.Requests[0].State == "decoding",
			fmt.Sprintf("the moved stream decoding its continuation; state %+v", st)
	})
	t.Run("a stream that moved shows its attempt while its continuation runs", func(t *testing.T) {
		if r := st.Requests[0]; r.ID != "moved" || r.State != "decoding" {
			t.Errorf("row %+v, want moved, decoding", r)
		}
		if *st.MigratedInFlight != 1 {
			t.Errorf("migrated_in_flight = %d, want 1", *st.MigratedInFlight)
		}
	})
	t.Run("the totals count the move, the refusal and the tokens replayed, as /metrics does", func(t *testing.T) {
		m := st.Migrations
		if m.ByReason["decoder_failed"]["migrated"] != 1 || m.ByReason["decoder_failed"]["not_migratable"] != 1 || *m.TokensReplayed != 3 {
			t.Errorf("by_reason %v, tokens_replayed %d; want decoder_failed: 1 migrated, 1 not_migratable; 3 tokens replayed", m.ByReason, *m.TokensReplayed)
		}
		if len(m.Refused) != 1 || m.Refused["logprobs"] != 1 {
			t.Errorf("refused %v, want logprobs 1", m.Refused)
		}
		for reason, by := range m.ByReason {
			for outcome, n := range by {
				if v := h.value("pdproxy_migrations_total", map[string]string{"reason": reason, "outcome": outcome}); float64(n) != v {
					t.Errorf("by_reason[%s][%s] = %d, /metrics says %v", reason, outcome, n, v)
				}
			}
		}
		if v := h.value("pdproxy_migration_tokens_replayed_total", nil); float64(*m.TokensReplayed) != v {
			t.Errorf("tokens_replayed = %d, /metrics says %v", *m.TokensReplayed, v)
		}
	})

	close(release)
	r := <-moved
	if r.err != nil || !r.s.done {
		t.Fatalf("the moved stream: %v, [DONE] %v\n%s", r.err, r.s.done, r.s.raw)
	}
	if got, want := r.s.text(t, false), wantGreedy(greedyPrompt("hello there"), 8); got != want {
		t.Errorf("the moved stream read %q, want the unbroken %q", got, want)
	}
	h.waitQuiet()
	st = h.liveState(nil)
	t.Run("once it ended, nothing moved is in flight and the totals stay", func(t *testing.T) {
		if *st.MigratedInFlight != 0 || len(st.Requests) != 0 {
			t.Errorf("migrated_in_flight %d, %d rows, want none", *st.MigratedInFlight, len(st.Requests))
		}
		if st.Migrations.ByReason["decoder_failed"]["migrated"] != 1 || *st.Migrations.TokensReplayed != 3 {
			t.Errorf("by_reason %v, tokens_replayed %d; want the move still counted", st.Migrations.ByReason, *st.Migrations.TokensReplayed)
		}
	})
}

// TestLiveViewNeedsTheKeyTheDebugRoutesNeed checks that the page and its state are closed as
// /debug/requests is when keys are configured, and served with one.
func TestLiveViewNeedsTheKeyTheDebugRoutesNeed(t *testing.T) {
	h := aggregated(t, Config{APIKeysFile: keysFile(t, "the-key\n")}, newEngine(t, vllmDecode))
	for _, path := range []string{"/debug/requests", "/debug/ui", "/debug/ui/state"} {
		t.Run(path, func(t *testing.T) {
			if resp, b := h.do(http.MethodGet, path, "", nil); resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("GET %s without a key = %d, want 401: %s", path, resp.StatusCode, b)
			}
			if resp, b := h.do(http.MethodGet, path, "", http.Header{"Authorization": {"Bearer the-key"}}); resp.StatusCode != http.StatusOK {
				t.Errorf("GET %s with the key = %d, want 200: %s", path, resp.StatusCode, b)
			}
		})
	}
}

func TestHoldsAreGroupedByPrefillerOldestFirst(t *testing.T) {
	secs := func(v float64) *float64 { return &v }
	held := func(id, prefill string, age float64) lifecycle.Info {
		return lifecycle.Info{ID: id, State: lifecycle.KVHeld, Prefill: prefill, KVHeld: true, KVHoldAgeSeconds: secs(age), KVHoldDeadlineInSeconds: secs(20 - age)}
	}
	backends := []router.BackendStatus{{Name: "p1", Role: routerconfig.RolePrefill}, {Name: "d0", Role: routerconfig.RoleDecode}, {Name: "p0", Role: routerconfig.RolePrefill}}
	summary := func(gs []PrefillerHolds) string {
		var out []string
		for _, g := range gs {
			var ids []string
			for _, h := range g.Holds {
				ids = append(ids, h.ID)
			}
			out = append(out, fmt.Sprintf("%s:%d[%s]", g.Prefill, g.Count, strings.Join(ids, ",")))
		}
		return strings.Join(out, " ")
	}
	many := make([]lifecycle.Info, 0, liveHoldsShown+5)
	for i := range liveHoldsShown + 5 {
		many = append(many, held(fmt.Sprint(i), "p0", float64(i)))
	}
	for _, tc := range []struct {
		name string
		rows []lifecycle.Info
		want string
	}{
		{"configured prefillers are listed in the router's order, holding or not", nil, "p1:0[] p0:0[]"},
		{"rows that hold nothing are no holds", []lifecycle.Info{{ID: "r", State: lifecycle.Decoding, Prefill: "p0"}}, "p1:0[] p0:0[]"},
		{"holds go oldest hold first, whatever the requests' order",
			[]lifecycle.Info{held("young", "p0", 1), held("old", "p0", 5), held("mid", "p1", 2)}, "p1:1[mid] p0:2[old,young]"},
		{"a prefiller a request's header named comes after the configured ones, by name",
			[]lifecycle.Info{held("z", "10.0.0.9:8000", 1), held("y", "10.0.0.1:8000", 1)}, "p1:0[] p0:0[] 10.0.0.1:8000:1[y] 10.0.0.9:8000:1[z]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := summary(holdsByPrefiller(tc.rows, backends)); got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
	t.Run("past the shown bound the count is of all and the oldest are listed", func(t *testing.T) {
		g := holdsByPrefiller(many, backends)[1]
		if g.Count != liveHoldsShown+5 || len(g.Holds) != liveHoldsShown || g.Holds[0].ID != fmt.Sprint(liveHoldsShown+4) {
			t.Errorf("count %d, %d listed, first %s; want %d, %d, the oldest", g.Count, len(g.Holds), g.Holds[0].ID, liveHoldsShown+5, liveHoldsShown)
		}
	})
}
