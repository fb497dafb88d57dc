package costmodel

import (
	"math"
	"testing"
	"time"
)

func TestTheBooksDrainAsTheEngineComputesThemOneAfterAnother(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	var bs Books
	a := &Entry{At: t0, Tokens: 1000}
	b := &Entry{At: t0.Add(100 * time.Millisecond), Tokens: 500}
	bs.Add(a)
	bs.Add(b)
	const secPerToken = 1e-3 // a token a millisecond
	for _, tc := range []struct {
		after time.Duration
		want  float64
	}{
		{0, 1500},                      // b not booked yet counts whole: it is in the books
		{400 * time.Millisecond, 1100}, // a 400 in
		{1200 * time.Millisecond, 300}, // a done at 1s, b 200 in
		{2 * time.Second, 0},           // both done by the model, their ends not told yet
	} {
		if got, n := bs.Remaining(t0.Add(tc.after), secPerToken); math.Abs(got-tc.want) > 1e-6 || n != 2 {
			t.Errorf("%s after the first booking: %.1f tokens of %d entries remain, want %.0f of 2", tc.after, got, n, tc.want)
		}
	}
	bs.Remove(a)
	if got, _ := bs.Remaining(t0.Add(400*time.Millisecond), secPerToken); math.Abs(got-200) > 1e-6 {
		t.Errorf("with the first gone, %.1f tokens remain 300ms after the second's booking, want 200", got)
	}
}
