package costmodel

import (
	"math"
	"testing"
	"time"
)

func TestThePoolsFitFindsTheRateAndTheFixedPart(t *testing.T) {
	newFit := func() *fit { return &fit{slope0: 1e-4, intercept0: 0.01} }
	f := newFit()
	if s, c := f.line(); s != 1e-4 || c != 0.01 {
		t.Errorf("with no lesson the line is %v, %v; want the configured 1e-4, 0.01", s, c)
	}
	// Prefills of 200 to 2,000 tokens taking 1ms + 5µs a token: a start of 10ms and 100µs a
	// token is twenty times too slow.
	for i := range 40 {
		x := float64(200 + 45*i)
		f.add(x, 0.001+x*5e-6)
	}
	if s, c := f.line(); math.Abs(s-5e-6) > 1e-7 || math.Abs(c-0.001) > 1e-4 {
		t.Errorf("fitted %v s/token + %v s, want 5e-6 + 0.001", s, c)
	}
	same := newFit()
	for range 40 {
		same.add(1000, 0.015)
	}
	if s, c := same.line(); math.Abs(s-5e-6) > 1e-9 || c != 0.01 {
		t.Errorf("prefills all of 1,000 tokens taking 15ms: %v s/token + %v s, want the configured 10ms and 5µs a token past it", s, c)
	}
}

func TestLatenessSettlesAtThe90thPercentileOfHowLatePredictionsRun(t *testing.T) {
	m := New(10*time.Millisecond, 1000, 0, 0)
	// Prefills late by 0 to 99 ms, evenly: one in ten is later than 90 ms.
	for i := range 20000 {
		m.NoteLate(time.Duration((i*37)%100) * time.Millisecond)
	}
	if got := m.Lateness(); got < 80*time.Millisecond || got > 100*time.Millisecond {
		t.Errorf("lateness = %v, want about 90 ms, the 90th percentile", got)
	}
	// Predictions that come true bring it back down.
	for range 2000 {
		m.NoteLate(-5 * time.Millisecond)
	}
	if got := m.Lateness(); got != 0 {
		t.Errorf("lateness after prefills on time = %v, want 0", got)
	}
}
