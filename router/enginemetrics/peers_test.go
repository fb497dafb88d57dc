package enginemetrics

import (
	"testing"
	"time"
)

// An engine is shared from the scrape that shows a request the client did not send, counted
// or still waiting or running, until some time later, and not before: its count runs behind
// the client's while requests are in flight, and starts again from zero when the engine
// restarts.
func TestAnEngineIsSharedWhileItShowsAnotherClientsRequests(t *testing.T) {
	const after, watch = 10 * time.Minute, 200 * time.Millisecond // watch: between scrapes
	t0 := time.Unix(1_000_000, 0)
	// A scrape: the engine's count and its requests waiting and running, the client's
	// requests started by the answer and ended when it was sent, its time from t0, and whether
	// the engine is the client's alone then.
	type scrape struct {
		served         float64
		inEngine       int64
		started, ended int64
		at             time.Duration
		wantSole       bool
	}
	tests := []struct {
		name    string
		scrapes []scrape
	}{
		{"the engine counts the client's requests as they end", []scrape{
			{0, 0, 0, 0, 0, true}, {3, 7, 10, 3, watch, true}, {10, 2, 12, 10, 2 * watch, true}}},
		{"requests in flight at the first scrape are counted after it", []scrape{
			{100, 5, 5, 0, 0, true}, {105, 0, 5, 5, watch, true}}},
		{"three requests counted beyond the client's are another client's, for a while", []scrape{
			{0, 0, 0, 0, 0, true}, {13, 0, 10, 10, watch, false}, {13, 0, 10, 10, after, false},
			{13, 0, 10, 10, watch + after, true}}},
		{"three requests running beyond the client's are another client's", []scrape{
			{0, 0, 0, 0, 0, true}, {0, 5, 2, 0, watch, false}, {5, 0, 2, 2, 2 * watch, false}}},
		{"another client's requests running at the first scrape", []scrape{
			{40, 3, 0, 0, 0, false}, {40, 0, 0, 0, watch, false}}},
		{"the client's later requests do not hide another's", []scrape{
			{0, 0, 0, 0, 0, true}, {8, 0, 5, 5, watch, false}, {20, 0, 17, 17, 2 * watch, false}}},
		{"requests counted after the client ended them do not add up across idle minutes", []scrape{
			{0, 0, 0, 0, 0, true}, {2, 0, 2, 2, time.Minute, true}, {4, 0, 2, 2, 2 * time.Minute, true},
			{6, 0, 4, 4, 3 * time.Minute, true}, {8, 0, 4, 4, 4 * time.Minute, true}}},
		{"another client's few requests between idle moments add up within a minute", []scrape{
			{0, 0, 0, 0, 0, true}, {1, 0, 0, 0, watch, true}, {2, 0, 0, 0, 2 * watch, true},
			{3, 0, 0, 0, 3 * watch, false}}},
		{"an engine restarted counts from zero", []scrape{
			{50, 0, 10, 10, 0, true}, {2, 0, 12, 12, watch, true}, {4, 0, 14, 14, 2 * watch, true}}},
		{"an engine that does not count its requests is never sole", []scrape{
			{-1, 0, 0, 0, 0, false}, {-1, 0, 10, 10, watch, false}}},
		{"an engine whose count shows once a request ended there", []scrape{
			{-1, 0, 0, 0, 0, false}, {-1, 0, 1, 0, watch, false}, {1, 0, 1, 1, 2 * watch, true},
			{5, 0, 2, 2, 3 * watch, false}}},
		{"an engine that stops counting is not sole until it counts again", []scrape{
			{0, 0, 0, 0, 0, true}, {1, 0, 1, 1, watch, true}, {-1, 0, 3, 3, 2 * watch, false},
			{9, 0, 5, 5, 3 * watch, true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Peers
			for i, s := range tt.scrapes {
				now := t0.Add(s.at)
				p = p.Next(Scrape{Load: Load{Running: s.inEngine, Requests: s.served}, Started: s.started, Ended: s.ended}, now)
				if got := p.Sole(now, after); got != s.wantSole {
					t.Errorf("scrape %d (%+v): sole = %v, want %v", i, s, got, s.wantSole)
				}
			}
		})
	}
}
