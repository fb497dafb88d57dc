// Package lifecycle owns the request table: every request the proxy is serving, the state it
// is in, and the KV hold a prefiller keeps for it. It is the only place a request's state
// changes. Each transition is atomic and answers with what the caller must do (cancel a call,
// release held KV, or nothing); an event for a request that already ended, or that the table
// no longer knows, is a counted no-op, so a late abort can never release KV twice.
package lifecycle

import "fmt"

// State is where a request is in its life. The zero value is Received.
type State uint8

// The states of a request. None is expired: a hold whose deadline passes is never
// forwarded (StartDecode), and the request goes on to a decoder that computes the prompt
// itself, so no request ends as expired; the hold's release reason says it. Finished, Aborted
// and Failed are terminal.
const (
	Received State = iota
	Prefilling
	KVHeld
	Decoding
	Finished
	Aborted
	Failed
	numStates
)

var stateNames = [numStates]string{"received", "prefilling", "kv_held", "decoding", "finished", "aborted", "failed"}

// String returns the snake_case name used in metrics, logs and /debug/requests.
func (s State) String() string {
	if s < numStates {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// MarshalText lets a State appear by name in JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// States lists every state, in the order of a request's life, the terminal ones last.
func States() []State {
	out := make([]State, numStates)
	for i := range out {
		out[i] = State(i)
	}
	return out
}

// Terminal reports whether no further transition can leave s.
func (s State) Terminal() bool { return s >= Finished }

// Action is what a transition asks its caller to do. The zero value means nothing.
type Action uint8

const (
	// None: nothing to do (also the answer to every late event).
	None Action = iota
	// CancelPrefill: cancel the prefill call; the prefiller may still hold KV for it (race R1).
	CancelPrefill
	// ReleaseKV: the prefiller holds KV for this request and nobody will pull it; release it now.
	// Exactly one transition per hold answers ReleaseKV.
	ReleaseKV
	// CancelDecode: cancel the decode call.
	CancelDecode
)

var actionNames = [...]string{"none", "cancel_prefill", "release_kv", "cancel_decode"}

// String names the action for logs.
func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// MarshalText lets an Action appear by name in JSON (the live view's recent aborts).
func (a Action) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// ReleaseReason says why a KV hold ended; it is the reason label of pdproxy_kv_releases_total.
type ReleaseReason string

// The release reasons. Every hold ends with exactly one of them.
const (
	// ReleaseDecoded: the params went to a decoder, which pulls the blocks and notifies the prefiller.
	ReleaseDecoded ReleaseReason = "decoded"
	// ReleaseDrained: a drain-only decode pulled the blocks after the client left.
	ReleaseDrained ReleaseReason = "drained"
	// ReleaseAborted: the engine's explicit abort freed them.
	ReleaseAborted ReleaseReason = "aborted"
	// ReleaseExpired: the proxy's hold deadline passed (or it was left to the engine's timer);
	// the params are never forwarded after this.
	ReleaseExpired ReleaseReason = "expired"
)

// handoff is who frees the blocks of a hold that ended for reason r: the result label of
// pdproxy_kv_hold_handoffs_total. left_to_engine is the one an operator watches: blocks
// that stay pinned until the prefiller's own lease ends.
func (r ReleaseReason) handoff() string {
	switch r {
	case ReleaseDecoded:
		return "handed_over"
	case ReleaseDrained, ReleaseAborted:
		return "released"
	}
	return "left_to_engine"
}
