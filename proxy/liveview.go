package proxy

import (
	_ "embed"
	"io"
	"net/http"
	"sort"
	"time"

	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// The live view: GET /debug/ui is one page, built into the binary with its CSS and script
// inline so that it works where nothing outside the cluster can be reached; it polls GET
// /debug/ui/state, which is all it shows. Both sit behind the same key as /debug/requests.

// liveViewPage is a string, not a []byte: nothing can change it.
//
//go:embed liveview.html
var liveViewPage string

// How much of the table one state carries: the page is polled twice a second, and at
// thousands of requests in flight a full list would cost more than it shows. The oldest
// rows are kept, since a request that lingers is the one to look at; the counts are always
// of everything.
const (
	liveRequestsShown = 200
	liveHoldsShown    = 100
)

// LiveState is the body of GET /debug/ui/state.
type LiveState struct {
	// Time is when the state was taken, by the proxy's clock.
	Time time.Time `json:"time"`
	// Draining is true once shutdown has begun (/ready answers 503).
	Draining bool `json:"draining"`
	// RequestsByState counts the table's rows by state; every state is present, zero
	// included. The terminal ones are requests ended but not yet forgotten: an abort whose
	// KV release is still on its way, a stream whose last bytes are being written.
	RequestsByState map[string]int `json:"requests_by_state"`
	// RequestsTotal is the number of rows in the table.
	RequestsTotal int `json:"requests_total"`
	// Requests are the oldest rows of the table, at most 200, in the shape of
	// GET /debug/requests: a request that moved to another decoder has its attempts.
	Requests []lifecycle.Info `json:"requests"`
	// MigratedInFlight is the number of rows in the table that moved to another decoder at
	// least once (attempts above 0), shown or not.
	MigratedInFlight int `json:"migrated_in_flight"`
	// Migrations are the streams that lost their decoder since the proxy started.
	Migrations pdflow.MigrationTotals `json:"migrations"`
	// KVHolds are the holds per prefiller: every configured prefiller, and any other one a
	// hold is on (a prefiller a request's header named).
	KVHolds []PrefillerHolds `json:"kv_holds"`
	// RecentAborts are the last 50 clients that left, newest first.
	RecentAborts []pdflow.AbortRecord `json:"recent_aborts"`
	// Backends are the engines, in the shape of GET /debug/backends.
	Backends []router.BackendStatus `json:"backends"`
}

// PrefillerHolds is the KV one prefiller holds for the proxy's requests.
type PrefillerHolds struct {
	// Prefill is the prefiller's name.
	Prefill string `json:"prefill"`
	// Count is the number of requests it holds KV for.
	Count int `json:"count"`
	// Holds are the oldest of them, at most 100.
	Holds []KVHold `json:"holds"`
}

// KVHold is one request's hold on a prefiller.
type KVHold struct {
	// ID is the request's id.
	ID string `json:"id"`
	// State is the request's state: kv_held while it waits for its decode, prefilling on
	// paired legs, aborted or failed while its release is on its way.
	State lifecycle.State `json:"state"`
	// AgeSeconds is how long the prefiller has held it.
	AgeSeconds float64 `json:"age_seconds"`
	// DeadlineInSeconds is the time left before its params stop being forwarded, negative
	// once passed; absent for paired legs, whose params never pass through the proxy.
	DeadlineInSeconds *float64 `json:"deadline_in_seconds,omitempty"`
}

func (s *Server) handleLiveView(w http.ResponseWriter, _ *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	// The page loads nothing and is framed by nothing; its script may only call back here.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
	w.WriteHeader(http.StatusOK)
	io.WriteString(w, liveViewPage)
}

func (s *Server) handleLiveState(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, http.StatusOK, s.liveState())
}

func (s *Server) liveState() LiveState {
	rows := s.table.Snapshot() // oldest first
	backends := s.router.Backends()
	st := LiveState{
		Time:            time.Now(),
		Draining:        s.draining.Load(),
		RequestsByState: make(map[string]int),
		RequestsTotal:   len(rows),
		Requests:        rows[:min(len(rows), liveRequestsShown)],
		KVHolds:         holdsByPrefiller(rows, backends),
		RecentAborts:    s.flow.RecentAborts(),
		Backends:        backends,
		Migrations:      s.m.MigrationTotals(),
	}
	for _, state := range lifecycle.States() {
		st.RequestsByState[state.String()] = 0
	}
	for _, r := range rows {
		st.RequestsByState[r.State.String()]++
		if r.Attempts > 0 {
			st.MigratedInFlight++
		}
	}
	return st
}

// holdsByPrefiller groups the rows that hold KV by prefiller, the configured prefillers
// first in the router's order, then any other, by name.
func holdsByPrefiller(rows []lifecycle.Info, backends []router.BackendStatus) []PrefillerHolds {
	out := []PrefillerHolds{}
	at := make(map[string]int)
	group := func(name string) *PrefillerHolds {
		i, ok := at[name]
		if !ok {
			i = len(out)
			at[name] = i
			out = append(out, PrefillerHolds{Prefill: name, Holds: []KVHold{}})
		}
		return &out[i]
	}
	for _, b := range backends {
		if b.Role == routerconfig.RolePrefill {
			group(b.Name)
		}
	}
	configured := len(out)
	for _, r := range rows {
		if !r.KVHeld || r.KVHoldAgeSeconds == nil {
			continue
		}
		g := group(r.Prefill)
		g.Count++
		g.Holds = append(g.Holds, KVHold{ID: r.ID, State: r.State, AgeSeconds: *r.KVHoldAgeSeconds, DeadlineInSeconds: r.KVHoldDeadlineInSeconds})
	}
	for i := range out {
		// Rows come oldest first by request, and a request's hold may be younger than that
		// of a request that came later (its prefill took longer): the page lists holds by age.
		h := out[i].Holds
		sort.SliceStable(h, func(i, j int) bool { return h[i].AgeSeconds > h[j].AgeSeconds })
		out[i].Holds = h[:min(len(h), liveHoldsShown)]
	}
	extra := out[configured:]
	sort.SliceStable(extra, func(i, j int) bool { return extra[i].Prefill < extra[j].Prefill })
	return out
}
