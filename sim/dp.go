package sim

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strconv"
)

// Data parallel ranks (Config.DataParallelSize), as a vLLM server started with
// --data-parallel-size serves them: one API server in front of N engines, each with its
// own scheduler, KV pool, engine id and KV event stream, a request choosing its rank by
// the X-data-parallel-rank header (vLLM's; rank 0 when absent, a 400 when out of range).
// The pull, notify and heartbeat calls of a decoder name the engine id of the rank that
// holds the blocks, which picks the rank. GET /debug/kv sums the ranks and lists each
// under ranks; GET /metrics reports the sums.

// HeaderDataParallelRank chooses the data parallel rank that serves a request.
const HeaderDataParallelRank = "X-data-parallel-rank"

// RankStats is one data parallel rank's part of KVStats.
type RankStats struct {
	// Rank is the rank's index behind the server, what X-data-parallel-rank names.
	Rank                int    `json:"rank"`
	EngineID            string `json:"engine_id"`
	RequestsTotal       int    `json:"requests_total"`
	BlocksTotal         int    `json:"blocks_total"`
	BlocksFree          int    `json:"blocks_free"`
	BlocksHeld          int    `json:"blocks_held"`
	BlocksInUse         int    `json:"blocks_in_use"`
	HeldRequests        int    `json:"held_requests"`
	RunningRequests     int    `json:"running_requests"`
	WaitingRequests     int    `json:"waiting_requests"`
	HoldsTotal          int    `json:"holds_total"`
	ExpiredTotal        int    `json:"expired_total"`
	KVBlocksPulledTotal int    `json:"kv_blocks_pulled_total"`
	// TransfersWaiting: Mooncake decodes of this rank waiting for their prefill.
	TransfersWaiting int `json:"transfers_waiting"`
}

// rankOf picks the rank a request's header names; nil and a 400 when it names none.
func (e *Engine) rankOf(h http.Header) (*Engine, error) {
	v := h.Get(HeaderDataParallelRank)
	if v == "" {
		return e.ranks[0], nil
	}
	r, err := strconv.Atoi(v)
	if err != nil || r < 0 || r >= len(e.ranks) {
		return nil, badRequest("invalid_data_parallel_rank", "%s %q: this server has data parallel ranks 0 to %d", HeaderDataParallelRank, v, len(e.ranks)-1)
	}
	return e.ranks[r], nil
}

// byRank serves a request on the rank its header names, with that rank's handler.
func (e *Engine) byRank(handler func(*Engine) http.HandlerFunc) http.HandlerFunc {
	hs := make([]http.HandlerFunc, len(e.ranks))
	for i, r := range e.ranks {
		hs[i] = handler(r)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		re, err := e.rankOf(r.Header)
		if err != nil {
			writeError(w, err)
			return
		}
		hs[re.rank](w, r)
	}
}

// byEngineID serves a pull, notify or heartbeat on the rank whose engine id its body
// names; a body naming none goes to rank 0, which answers it.
func (e *Engine) byEngineID(handler func(*Engine) http.HandlerFunc) http.HandlerFunc {
	if len(e.ranks) == 1 {
		return handler(e)
	}
	hs := make(map[string]http.HandlerFunc, len(e.ranks))
	for _, r := range e.ranks {
		hs[r.id] = handler(r)
	}
	first := handler(e)
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes))
		if err != nil {
			writeError(w, badRequest("unreadable_body", "read request body: %v", err))
			return
		}
		var id struct {
			EngineID string `json:"engine_id"`
		}
		_ = json.Unmarshal(body, &id) // a bad body is the handler's to answer
		r.Body = io.NopCloser(bytes.NewReader(body))
		if h, ok := hs[id.EngineID]; ok {
			h(w, r)
			return
		}
		first(w, r)
	}
}

// Stats returns a snapshot of the KV pool and counters (GET /debug/kv): the sums over
// the data parallel ranks, and each rank's own under Ranks.
func (e *Engine) Stats() KVStats {
	var sum KVStats
	for _, r := range e.ranks {
		s := r.rankStats()
		addStats(&sum, s)
		if sum.Priorities == nil {
			sum.Priorities = make(map[string]int)
		}
		for p, n := range s.Priorities {
			sum.Priorities[p] += n
		}
		sum.Ranks = append(sum.Ranks, RankStats{
			Rank: r.rank, EngineID: r.id, RequestsTotal: s.RequestsTotal,
			BlocksTotal: s.BlocksTotal, BlocksFree: s.BlocksFree, BlocksHeld: s.BlocksHeld, BlocksInUse: s.BlocksInUse,
			HeldRequests: s.HeldRequests, RunningRequests: s.RunningRequests, WaitingRequests: s.WaitingRequests,
			HoldsTotal: s.HoldsTotal, ExpiredTotal: s.ExpiredTotal, KVBlocksPulledTotal: s.KVBlocksPulledTotal,
			TransfersWaiting: s.TransfersWaiting,
		})
	}
	return sum
}

// addStats adds every counter and gauge of s to sum. Every int field of KVStats is a
// count that sums across ranks, so reflection keeps a new field from being forgotten.
func addStats(sum *KVStats, s KVStats) {
	dst, src := reflect.ValueOf(sum).Elem(), reflect.ValueOf(s)
	for i := range dst.NumField() {
		if f := dst.Field(i); f.Kind() == reflect.Int {
			f.SetInt(f.Int() + src.Field(i).Int())
		}
	}
}
