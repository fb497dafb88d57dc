package router

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap"
)

// Run checks every backend's health every health.interval, resolves every discover entry's
// name again every refresh, and scrapes the engines' load for the pools whose policy weighs it every
// scrape_interval (load.go), until ctx is done, then returns nil. It owns the check, lookup
// and scrape goroutines and waits for them. Call it once. With checks disabled it only
// waits, so a Reload that enables them takes effect.
func (r *Router) Run(ctx context.Context) error {
	defer func() {
		// Health checks and scrapes leave keep-alive connections behind; the requests' own
		// connections are dropped by their callers' transports when idle.
		for _, b := range r.backends() {
			b.closeIdle()
		}
	}()
	var discovering sync.WaitGroup
	defer discovering.Wait()
	discovering.Go(func() { r.disc.run(ctx) })
	var scraper sync.WaitGroup
	scraper.Go(func() { r.scrapeLoop(ctx) })
	scraper.Go(func() { r.runEvents(ctx) })
	scraper.Go(func() { r.checkTokenizersLoop(ctx) })
	if r.shares != nil {
		scraper.Go(func() { r.shareLoop(ctx) })
	}
	defer scraper.Wait()
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
func (r *Router) checkAll(ctx context.Context, h routerconfig.HealthConfig) {
	var wg sync.WaitGroup
	for _, b := range r.backends() {
		wg.Go(func() {
			err := r.probe(ctx, b, h)
			if ctx.Err() != nil {
				return // shutting down: a failed probe says nothing about the backend
			}
			if err == nil && b.models == nil {
				r.listModels(ctx, b, h)
			}
			if err == nil && b.kvDiscover {
				r.listKVSources(ctx, b, h)
			}
			ref, refused := refusalOf(err)
			change, why := b.check(err == nil, ref.text, h)
			switch change {
			case 1:
				r.logger.Info("backend up", zap.String("backend", b.Name), zap.String("role", string(b.Role)))
			case -1:
				label := "health_check"
				if refused {
					label = ref.label
				}
				r.wentDown(b, label, why, err)
			}
		})
	}
	wg.Wait()
	// A backend that came up, or whose ejection ended, can take waiting requests.
	r.prefill.kick()
	r.decode.kick()
}

// probe is one GET {url}{path}; any 2xx passes (nil), anything else is the error.
func (r *Router) probe(ctx context.Context, b *Backend, h routerconfig.HealthConfig) error {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	u := strings.TrimSuffix(b.URLString, "/") + h.Path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := b.client.Do(req)
	if err != nil {
		if ce := r.logger.Check(zap.DebugLevel, "health check failed"); ce != nil {
			ce.Write(zap.String("backend", b.Name), zap.Error(err))
		}
		return err
	}
	// Drain a little so the connection can be reused, but never read a huge body.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("health check answered %d", resp.StatusCode)
	}
	return nil
}

// listModels asks a healthy engine which models it serves (GET /v1/models: its served
// names and LoRA adapters) and keeps the answer. An engine that does not answer keeps what it
// said last: a list is not forgotten because one call failed.
func (r *Router) listModels(ctx context.Context, b *Backend, h routerconfig.HealthConfig) {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(b.URLString, "/")+"/v1/models", nil)
	if err != nil {
		return
	}
	resp, err := b.client.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&list) != nil {
		if ce := r.logger.Check(zap.DebugLevel, "model list not read"); ce != nil {
			ce.Write(zap.String("backend", b.Name), zap.Int("status", resp.StatusCode))
		}
		return
	}
	models := make([]string, 0, len(list.Data))
	var adapters []string
	for _, m := range list.Data {
		if m.ID != "" && !slices.Contains(models, m.ID) {
			models = append(models, m.ID)
			if m.Parent != nil && *m.Parent != "" && *m.Parent != m.ID {
				adapters = append(adapters, m.ID)
			}
		}
	}
	var oldAdapters []string
	if p := b.st.served.adapters.Load(); p != nil {
		oldAdapters = *p
	}
	if old := b.st.served.models.Load(); old == nil || !slices.Equal(*old, models) || !slices.Equal(oldAdapters, adapters) {
		r.logger.Info("backend models", zap.String("backend", b.Name), zap.Strings("models", models), zap.Strings("lora_adapters", adapters))
		b.st.served.adapters.Store(&adapters)
		b.st.served.models.Store(&models)
		r.forgetModels()
	}
}

// refused takes b out after a call to it was refused at connect: down until the active
// checks bring it back, or, with them off, ejected for the back-off (then on probation), so
// that it is never stranded, and so that live requests do not each find out that it is gone.
func (r *Router) refused(b *Backend, ref refusal, err error) {
	st := r.settings.Load()
	if st.health.Interval > 0 {
		if b.markDown(ref.text) {
			r.wentDown(b, ref.label, ref.text, err)
		}
		return
	}
	if d := b.ejectRefused(r.now(), st.ejection, ref.text); d > 0 {
		r.wentDown(b, ref.label, reasonEjectRefused+ref.text, err, zap.Duration("backoff", d))
	}
}

// wentDown counts and logs, once per change, a backend taken out by a refusal or its checks.
func (r *Router) wentDown(b *Backend, label, why string, err error, fields ...zap.Field) {
	if !b.st.removed.Load() {
		r.metrics.down.WithLabelValues(b.Name, string(b.Role), label).Inc()
	}
	fields = append([]zap.Field{zap.String("backend", b.Name), zap.String("role", string(b.Role)),
		zap.String("reason", why), zap.Error(err)}, fields...)
	r.logger.Warn("backend down", fields...)
	r.forgetCache(b)
}
