package router

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Run checks every backend's health every health.interval until ctx is done, then
// returns nil. It owns the check goroutines and waits for them. Call it once. With
// checks disabled it only waits, so a Reload that enables them takes effect.
func (r *Router) Run(ctx context.Context) error {
	defer func() {
		// Health checks leave keep-alive connections behind; the requests' own
		// connections are dropped by their callers' transports when idle.
		for _, b := range r.backends() {
			b.closeIdle()
		}
	}()
	timer := time.NewTimer(0) // the first round at once
	defer timer.Stop()
	for {
		h := r.settings.Load().health
		if h.Interval <= 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-r.reloaded:
				continue
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.reloaded:
			continue
		case <-timer.C:
			r.checkAll(ctx, h)
			timer.Reset(h.Interval)
		}
	}
}

// checkAll checks every backend at once, so one slow backend does not delay the others'
// verdicts, and returns when all checks are done.
func (r *Router) checkAll(ctx context.Context, h HealthConfig) {
	var wg sync.WaitGroup
	for _, b := range r.backends() {
		wg.Go(func() {
			ok := r.probe(ctx, b, h)
			if ctx.Err() != nil {
				return // shutting down: a failed probe says nothing about the backend
			}
			switch b.check(ok, h) {
			case 1:
				r.logger.Info("backend up", zap.String("backend", b.Name), zap.String("role", string(b.Role)))
			case -1:
				r.logger.Warn("backend down", zap.String("backend", b.Name), zap.String("role", string(b.Role)),
					zap.Int("failed_checks", h.UnhealthyThreshold))
			}
		})
	}
	wg.Wait()
	// A backend that came up, or whose ejection ended, can take waiting requests.
	r.prefill.kick()
	r.decode.kick()
}

// probe is one GET {url}{path}; any 2xx passes.
func (r *Router) probe(ctx context.Context, b *Backend, h HealthConfig) bool {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	u := strings.TrimSuffix(b.URLString, "/") + h.Path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return false
	}
	resp, err := b.client.Do(req)
	if err != nil {
		if ce := r.logger.Check(zap.DebugLevel, "health check failed"); ce != nil {
			ce.Write(zap.String("backend", b.Name), zap.Error(err))
		}
		return false
	}
	// Drain a little so the connection can be reused, but never read a huge body.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	resp.Body.Close()
	return resp.StatusCode >= 200 && resp.StatusCode < 300
}
