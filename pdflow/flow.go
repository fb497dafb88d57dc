package pdflow

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"

	"github.com/pdproxy/pdproxy/lifecycle"
)

// Flow serves requests across the engines: what the prefill/decode flow keeps beyond each
// request. The table has the requests themselves, the router the backends.
type Flow struct {
	cfg    Config
	router Router
	table  *lifecycle.Table
	logger *zap.Logger
	m      *Metrics
	// bg tracks work that outlives a request on purpose (KV releases after the client left,
	// prefills let finish); Server.Wait waits for it.
	bg sync.WaitGroup
	// stopping is closed once Wait is called (the proxy is shutting down): a drain that waits
	// for a decoder to come back gives up then.
	stopping chan struct{}
	stopOnce sync.Once
	// bootstraps caches what paired prefillers' bootstrap servers said.
	bootstraps bootstrapCache
	// tr traces requests (WithTracerProvider); nil when tracing is off.
	tr *tracer
	// aborts are the last clients that left, for the live view.
	aborts *abortRing
	// sidecar is set in llm-d's sidecar slot (prefiller_header): a request's prefiller is the
	// one its header named.
	sidecar bool
	// placements is where replicas share where the heads of prompts went (SharePlacements);
	// nil when they share nothing.
	placements Placements
}

// New is the flow of cfg (its defaults filled in and checked by the proxy), over rt and table;
// m are the proxy's metrics. sidecar says the flow is in llm-d's sidecar slot.
func New(cfg Config, rt Router, table *lifecycle.Table, logger *zap.Logger, m *Metrics, sidecar bool) *Flow {
	return &Flow{cfg: cfg, router: rt, table: table, logger: logger, m: m, aborts: newAbortRing(recentAbortsKept), sidecar: sidecar,
		stopping: make(chan struct{})}
}

// Trace traces the flow's requests, their calls and releases with tp's tracer.
func (f *Flow) Trace(tp trace.TracerProvider) {
	f.tr = &tracer{t: tp.Tracer("github.com/pdproxy/pdproxy/proxy"),
		prop: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})}
}

// RecentAborts are the last requests whose clients left, the latest first.
func (f *Flow) RecentAborts() []AbortRecord { return f.aborts.list() }

// Wait blocks until the work that outlives requests (KV releases, finishing prefills) is done
// or ctx ends. Drains waiting for a decoder to be usable stop waiting: the proxy is stopping,
// and their holds are left to the prefillers' timers.
func (f *Flow) Wait(ctx context.Context) error {
	f.stopOnce.Do(func() { close(f.stopping) })
	done := make(chan struct{})
	go func() { f.bg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// bootstrapCache is what paired prefillers' bootstrap servers said, by URL (known), and the
// discoveries under way (fetch), which concurrent first requests share.
type bootstrapCache struct {
	known sync.Map
	fetch singleflight.Group
}
