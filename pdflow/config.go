package pdflow

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Router is what the flow needs of the router: a backend lease per call, the backends that
// may be picked now for calls outside a lease, and its view of the pools.
type Router interface {
	Acquire(ctx context.Context, role routerconfig.Role, h router.Hint) (*router.Lease, error)
	Available(role routerconfig.Role) []*router.Backend
	Usable(b *router.Backend) bool
	Has(role routerconfig.Role) bool
	Ready() bool
	Backends() []router.BackendStatus
	Models(role routerconfig.Role) (models []string, complete bool)
	Heads(role routerconfig.Role, h router.Hint, turnEnds []int) ([]router.Head, time.Duration)
	SpreadEngines(role routerconfig.Role, h router.Hint) []string
}

var _ Router = (*router.Router)(nil)

// Abort modes, release modes, pull modes, reservations and what a pool without prefillers
// does: the values of the flow's settings.
const (
	AbortPrefillCancel         = "cancel"
	AbortPrefillFinishThenFree = "finish_then_release"
	ReleaseDrain               = "drain"
	ReleaseAbort               = "abort"
	ReleaseWait                = "wait"
	PullAbortImmediate         = "immediate"
	PullAbortAfterFirstToken   = "after_first_token"
	ReserveBeforePrefill       = "before_prefill"
	ReserveAfterPrefill        = "after_prefill"
	PrefillUnavailableDecode   = "decode_only"
	PrefillUnavailableFail     = "fail"
)

const (
	// DefaultPhaseTimeout bounds a prefill, a decode's first byte and its silences.
	DefaultPhaseTimeout = 5 * time.Minute
	// defaultAbortCallTimeout bounds an explicit abort or a drain's call to an engine.
	defaultAbortCallTimeout = 2 * time.Second
)

// Config is how the flow serves a request: the proxy's keys of the same names (proxy.Config),
// their defaults filled in and checked there.
type Config struct {
	AbortDuringPrefill       string
	KVRelease                string
	AbortDuringKVPull        string
	DecoderReservation       string
	PDUncachedTokenThreshold int
	MigrationLimit           int
	MigrationMaxTokens       int
	PrefillTimeout           time.Duration
	DecodeFirstByteTimeout   time.Duration
	DecodeIdleTimeout        time.Duration
	DrainTimeout             time.Duration
	ClientWriteTimeout       time.Duration
	PrefillRetries           int
	DecodeRetries            int
	DecodeOnlyFallback       *bool
	PrefillUnavailable       string
}
