package enginemetrics

import (
	"testing"
	"time"
)

// An engine is shared from the scrape that counts a request the client did not send until
// some time later, and not before: its count runs behind the client's while requests are in
// flight, and starts again from zero when the engine restarts.
func TestAnEngineIsSharedWhileItCountsAnotherClientsRequests(t *testing.T) {
	const after = 10 * time.Minute
	t0 := time.Unix(1_000_000, 0)
	// A scrape: the engine's count, the client's requests started by the answer and ended
	// when it was sent, its time from t0, and whether the engine is the client's alone then.
	type scrape struct {
		served         float64
		started, ended int64
		at             time.Duration
		wantSole       bool
	}
	tests := []struct {
		name    string
		scrapes []scrape
	}{
		{"the engine counts the client's requests as they end", []scrape{
			{0, 0, 0, 0, true}, {3, 10, 3, time.Second, true}, {10, 12, 10, 2 * time.Second, true}}},
		{"requests in flight at the first scrape are counted after it", []scrape{
			{100, 5, 0, 0, true}, {105, 5, 5, time.Second, true}}},
		{"three requests beyond the client's are another client's, for a while", []scrape{
			{0, 0, 0, 0, true}, {13, 10, 10, time.Second, false}, {13, 10, 10, after, false},
			{13, 10, 10, after + time.Second, true}}},
		{"the client's later requests do not hide another's", []scrape{
			{0, 0, 0, 0, true}, {8, 5, 5, time.Second, false}, {20, 17, 17, 2 * time.Second, false}}},
		{"an engine restarted counts from zero", []scrape{
			{50, 10, 10, 0, true}, {2, 12, 12, time.Second, true}, {4, 14, 14, 2 * time.Second, true}}},
		{"an engine that does not count its requests is never sole", []scrape{
			{-1, 0, 0, 0, false}, {-1, 10, 10, time.Second, false}}},
		{"an engine that stops counting is not sole, and starts again when it counts", []scrape{
			{0, 0, 0, 0, true}, {-1, 3, 3, time.Second, false}, {9, 5, 5, 2 * time.Second, true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Peers
			for i, s := range tt.scrapes {
				now := t0.Add(s.at)
				p = p.Next(s.served, s.started, s.ended, now)
				if got := p.Sole(now, after); got != s.wantSole {
					t.Errorf("scrape %d (%+v): sole = %v, want %v", i, s, got, s.wantSole)
				}
			}
		})
	}
}
