package router

import "errors"

// Errors returned by Acquire. The proxy maps them to HTTP answers.
var (
	// ErrNoBackend means no healthy backend of the role is available: answer 503.
	ErrNoBackend = errors.New("router: no healthy backend")
	// ErrQueueFull means every eligible backend is full and so is the wait queue: 429. With
	// flows (Hint.Flow), the queue answers ErrTenantQueueFull or ErrPoolSaturated instead.
	ErrQueueFull = errors.New("router: all backends busy and queue full")
	// ErrQueueTimeout means the request waited queue.timeout for a free backend: 503.
	ErrQueueTimeout = errors.New("router: timed out waiting for a free backend")
)

// Errors of the fair queue (Hint.Flow), beside those of Acquire above.
var (
	// ErrTenantQueueFull means the request's flow already has its share of the wait queue
	// waiting (Flow.MaxQueue, or its weighted share of a full queue): answer 429, the tenant
	// is over its share while others are not.
	ErrTenantQueueFull = errors.New("router: the tenant's share of the wait queue is full")
	// ErrPoolSaturated means the wait queue is full and no flow in it is over its share: the
	// whole pool is saturated past its queue, whoever asks. Answer 503.
	ErrPoolSaturated = errors.New("router: every backend busy and the wait queue full within every tenant's share")
)

// reason is the reason label of pdproxy_queue_rejected_total for an error of Acquire.
func reason(err error) string {
	switch {
	case errors.Is(err, ErrQueueFull):
		return "full"
	case errors.Is(err, ErrTenantQueueFull):
		return "tenant_full"
	case errors.Is(err, ErrPoolSaturated):
		return "saturated"
	case errors.Is(err, ErrQueueTimeout):
		return "timeout"
	case errors.Is(err, ErrNoBackend):
		return "no_backend"
	}
	return "canceled"
}
