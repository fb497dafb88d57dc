package sharedstate

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// flowsTTL keeps a window's totals a little past the minute they count, for the replicas
// whose clocks run behind.
const flowsTTL = 3 * time.Minute

// ShareFlows adds served to window's totals of what the replicas' fair queues served, and
// answers the totals of want's fields, in one round trip within the budget. A field is a
// role and a flow's opaque key (no client's own value: a named tenant, or a hash); each is
// hashed into Redis's field, so that nothing a client sends sizes it. While Redis is down it
// answers ErrUnavailable at once: each replica is then fair on its own.
func (s *Store) ShareFlows(ctx context.Context, window int64, served map[string]float64, want []string) (map[string]float64, error) {
	if s.down.Load() {
		s.m.errors.WithLabelValues(opFlows).Inc()
		return nil, ErrUnavailable
	}
	key := s.cfg.Redis.KeyPrefix + "flows:" + strconv.FormatInt(window, 10)
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	pipe := s.rdb.Pipeline()
	for f, v := range served {
		pipe.HIncrByFloat(ctx, key, hash(f), v)
	}
	if len(served) > 0 {
		pipe.Expire(ctx, key, flowsTTL)
	}
	fields := make([]string, len(want))
	for i, f := range want {
		fields[i] = hash(f)
	}
	var got interface{ Result() ([]any, error) }
	if len(fields) > 0 {
		got = pipe.HMGet(ctx, key, fields...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != context.DeadlineExceeded {
			return nil, ctx.Err()
		}
		s.fail(opFlows, err)
		return nil, fmt.Errorf("shared state: flows: %w", err)
	}
	totals := make(map[string]float64, len(want))
	if got == nil {
		return totals, nil
	}
	vals, _ := got.Result()
	for i, v := range vals {
		if i >= len(want) {
			break
		}
		str, ok := v.(string)
		if !ok {
			continue // nil: no replica served it this window
		}
		n, err := strconv.ParseFloat(str, 64)
		if err != nil {
			s.fail(opFlows, fmt.Errorf("flows: field of %q is %q, not a number", want[i], str))
			return nil, ErrUnavailable
		}
		totals[want[i]] = n
	}
	return totals, nil
}
