package sharedstate

import (
	"context"
	"fmt"
	"time"
)

// maxPlacementKeys bounds the heads one Placements call reads; the rest are not read.
const maxPlacementKeys = 8

// Placements answers which engine of role the replicas last sent each of keys to (the heads
// of a prompt: an opaque string each, hashed before use), in one round trip within the
// budget: "" for a head no replica placed within its TTL. It reads the first 8 keys. While
// Redis is down it answers ErrUnavailable at once: the replica then weighs what it routed
// alone.
func (s *Store) Placements(ctx context.Context, role string, keys []string) ([]string, error) {
	if len(keys) > maxPlacementKeys {
		keys = keys[:maxPlacementKeys]
	}
	if len(keys) == 0 {
		return nil, nil
	}
	if s.down.Load() {
		s.m.errors.WithLabelValues(opPlacements).Inc()
		return nil, ErrUnavailable
	}
	names := make([]string, len(keys))
	for i, k := range keys {
		names[i] = s.key("head", role+"\x00"+k)
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
	engines := make([]string, len(keys))
	for i, v := range vals {
		if str, ok := v.(string); ok && i < len(engines) && len(str) <= maxBindingBytes {
			engines[i] = str
		}
	}
	return engines, nil
}

// Place records, off the request path, that the prompt head key of role went to engine, for
// ttl from now (each Place starts it again, and the latest engine wins). One the queue cannot
// take is dropped and counted: the head's next request places it again.
func (s *Store) Place(role, key, engine string, ttl time.Duration) {
	if key == "" || role == "" || engine == "" || ttl <= 0 || len(engine) > maxBindingBytes {
		return
	}
	s.enqueue(op{kind: opPlace, key: s.key("head", role+"\x00"+key), engine: engine, ttl: ttl})
}
