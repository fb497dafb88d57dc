package sharedstate

import (
	"context"
	"fmt"
	"time"
)

// maxPlacementKeys bounds the heads one Placements call reads; the rest are not read.
const maxPlacementKeys = 8

// Head names one head of a prompt in one pool: the pool's role, and the head's key, an opaque
// string hashed before use.
type Head struct {
	Role, Key string
}

// headKey is the head's Redis key.
func (s *Store) headKey(h Head) string { return s.key("head", h.Role+"\x00"+h.Key) }

// Placements answers which engine the replicas last sent each of heads to, in one round trip
// within the budget, whatever their roles: "" for a head no replica placed within its TTL.
// It reads the first 8 heads. While Redis is down it answers ErrUnavailable at once: the
// replica then weighs what it routed alone.
func (s *Store) Placements(ctx context.Context, heads []Head) ([]string, error) {
	if len(heads) > maxPlacementKeys {
		heads = heads[:maxPlacementKeys]
	}
	if len(heads) == 0 {
		return nil, nil
	}
	if s.down.Load() {
		s.m.errors.WithLabelValues(opPlacements).Inc()
		return nil, ErrUnavailable
	}
	names := make([]string, len(heads))
	for i, h := range heads {
		names[i] = s.headKey(h)
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	vals, err := s.rdb.MGet(ctx, names...).Result()
	if err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != context.DeadlineExceeded {
			return nil, ctx.Err() // the caller gave up: no news of Redis
		}
		s.fail(opPlacements, err)
		return nil, fmt.Errorf("shared state: placements: %w", err)
	}
	engines := make([]string, len(heads))
	for i, v := range vals {
		if str, ok := v.(string); ok && i < len(engines) && len(str) <= maxBindingBytes {
			engines[i] = str
		}
	}
	return engines, nil
}

// Place records, off the request path, that head went to engine, for ttl from now (each Place
// starts it again, and the latest engine wins). One the queue cannot take is dropped and
// counted: the head's next request places it again.
func (s *Store) Place(h Head, engine string, ttl time.Duration) {
	if h.Key == "" || h.Role == "" || engine == "" || ttl <= 0 || len(engine) > maxBindingBytes {
		return
	}
	s.enqueue(op{kind: opPlace, key: s.headKey(h), engine: engine, ttl: ttl})
}
