package pdflow

import (
	"errors"

	"github.com/pdproxy/pdproxy/api"
)

// errFreshPair is what an attempt ends with when the request goes on on a fresh pair: what the
// attempt held is on its way out, and the request's custody holds nothing.
var errFreshPair = api.NewError(api.KindBackendUnreachable, "the pair failed before the first byte; the request goes on on a fresh pair")

// errMoveOn is what an attempt ends with when its stream is to go on on another decoder: the
// custody is still the exchange's, and serve starts the next attempt.
var errMoveOn = api.NewError(api.KindBackendUnreachable, "the decoder failed mid-answer; the stream goes on elsewhere")

// errErrorEvent is a decoder's stream that carried an error event.
var errErrorEvent = errors.New("the decoder's stream carried an error event")

// errNotInTable is a call the table no longer lets go out: the request was aborted (its
// client left, or shutdown gave up on it) as it moved to another engine.
var errNotInTable = errors.New("the request left the table")

// errDecoderLeaving is the cause a decode is cut with when its decoder goes away mid-answer
// (router.Backend.Leaving) and the stream can go on elsewhere.
var errDecoderLeaving = errors.New("the decoder is going away")

// errEnginePanic is an engine call that panicked (an engine adapter's bug, or its
// transport's), made an error so that the call's owner releases what it holds as for any
// failed call.
var errEnginePanic = errors.New("an engine call panicked")
