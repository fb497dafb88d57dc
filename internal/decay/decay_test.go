package decay

import (
	"sync"
	"testing"
	"time"
)

func TestACountHalvesEveryHalfLife(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	var c Count
	if v := c.Value(t0); v != 0 {
		t.Fatalf("zero value %v, want 0", v)
	}
	c.Add(t0, 40)
	for _, tc := range []struct {
		after time.Duration
		want  float64
	}{{0, 40}, {HalfLife, 20}, {2 * HalfLife, 10}, {-time.Second, 40}} {
		if v := c.Value(t0.Add(tc.after)); v < tc.want-0.001 || v > tc.want+0.001 {
			t.Errorf("after %v: %v, want %v", tc.after, v, tc.want)
		}
	}
	c.Add(t0.Add(HalfLife), 5)
	if v := c.Value(t0.Add(HalfLife)); v < 24.999 || v > 25.001 {
		t.Errorf("20 left after a half-life, 5 added: %v, want 25", v)
	}
}

func TestACountIsSafeForConcurrentUse(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	var c Count
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				c.Add(t0, 1)
				c.Value(t0)
			}
		})
	}
	wg.Wait()
	if v := c.Value(t0); v != 8000 {
		t.Errorf("8 goroutines added 1,000 each at one instant: %v, want 8,000", v)
	}
}
