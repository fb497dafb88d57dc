package pdflow

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/api"
)

var (
	errFirstByteTimeout = fmt.Errorf("%w: no first byte from the decoder", api.ErrPhaseTimeout)
	errIdleTimeout      = fmt.Errorf("%w: the decoder went silent", api.ErrPhaseTimeout)
)

// ackGrace bounds how long a decode whose client left waits for the decoder's acknowledgement
// before it is cut: a healthy server acknowledges as soon as its handler reads the body.
const ackGrace = time.Second

// watchdog bounds a decode's phases (first byte, silence between chunks) and defers the
// client's cancel, when asked: to the decode's first byte (abort_during_kv_pull
// after_first_token), and, for a decode that carries a hold, to the decoder's acknowledgement
// (or ackGrace), so that the proxy learns whether the decoder has the params before it cuts
// the call.
type watchdog struct {
	ctx        context.Context
	cancel     context.CancelCauseFunc
	timer      *time.Timer
	idle       time.Duration
	toByte     bool // defer the client's cancel to the first byte
	toAck      bool // defer the client's cancel to the acknowledgement
	sawByte    atomic.Bool
	acked      atomic.Bool
	clientGone atomic.Bool
	timeout    atomic.Bool
	graceOnce  sync.Once
	grace      *time.Timer
	stopAfter  func() bool
}

func newWatchdog(client context.Context, toByte, toAck bool, firstByte, idle time.Duration) *watchdog {
	base := client
	if toByte || toAck {
		// Detached from the client on purpose: clientLeft cancels it when the wait is over.
		base = context.WithoutCancel(client)
	}
	ctx, cancel := context.WithCancelCause(base)
	wd := &watchdog{ctx: ctx, cancel: cancel, idle: idle, toByte: toByte, toAck: toAck}
	wd.timer = time.AfterFunc(firstByte, func() {
		wd.timeout.Store(true)
		if wd.sawByte.Load() {
			cancel(errIdleTimeout)
		} else {
			cancel(errFirstByteTimeout)
		}
	})
	if toByte || toAck {
		wd.stopAfter = context.AfterFunc(client, func() {
			wd.clientGone.Store(true)
			wd.cancelIfDone()
		})
	}
	return wd
}

// cancelIfDone cancels the call for a client that left, once nothing it waits for is pending.
func (wd *watchdog) cancelIfDone() {
	if !wd.clientGone.Load() || wd.toByte && !wd.sawByte.Load() {
		return
	}
	if wd.toAck && !wd.acked.Load() {
		wd.graceOnce.Do(func() {
			wd.grace = time.AfterFunc(ackGrace, func() { wd.cancel(context.Canceled) })
		})
		return
	}
	wd.cancel(context.Canceled)
}

// onAck records the decoder's acknowledgement of the decode.
func (wd *watchdog) onAck() {
	if !wd.acked.Swap(true) {
		wd.cancelIfDone()
	}
}

func (wd *watchdog) onBytes() {
	if !wd.sawByte.Swap(true) {
		wd.acked.Store(true)
		wd.cancelIfDone()
	}
	wd.timer.Reset(wd.idle)
}

func (wd *watchdog) timedOut() bool { return wd.timeout.Load() }

// cutWhenLeaving cuts the decode when leaving closes, if may still says so then: a stream that
// can go on on another decoder leaves one that is draining or gone before it breaks. The wait
// ends with the decode.
func (wd *watchdog) cutWhenLeaving(leaving <-chan struct{}, may func() bool) {
	if leaving == nil {
		return
	}
	go func() {
		select {
		case <-leaving:
			if may() {
				wd.cancel(errDecoderLeaving)
			}
		case <-wd.ctx.Done():
		}
	}()
}

func (wd *watchdog) stop() {
	wd.timer.Stop()
	if wd.stopAfter != nil {
		wd.stopAfter()
	}
	wd.graceOnce.Do(func() {}) // no grace timer starts after this
	if wd.grace != nil {
		wd.grace.Stop()
	}
	wd.cancel(context.Canceled)
}
