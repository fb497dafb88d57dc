package sim

import (
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// A request inside the engine: where the step has it (reqState), what the
// step hands its handler (output) and what a handler hands the step
// (event); and the room (SGLang) or transfer (Mooncake) in which a
// prefill waits for its decoder.

// reqState is where a request is in the scheduler.
type reqState uint8

const (
	stateNew        reqState = iota // submitted, not yet seen by a step
	stateWaiting                    // in the FIFO queue, no blocks
	statePrefilling                 // blocks allocated, prefill computing
	statePulling                    // decode: blocks allocated, waiting for the pull (vLLM's WAITING_FOR_REMOTE_KVS)
	stateDecoding                   // emitting tokens
	stateHeld                       // prefill finished, blocks held for a decoder's read
	stateDone                       // finished, aborted, failed or expired: owns nothing
)

// request is one request inside the engine. Fields under "scheduler" belong
// to the step (Engine.mu); the output queue has its own lock so a slow
// client never blocks the scheduler.
type request struct {
	seq          uint64
	rid          string
	kind         reqKind
	promptTokens int
	maxTokens    int
	minTokens    int
	ignoreEOS    bool
	priority     int               // vLLM's: lower is scheduled first under the priority policy
	remote       *kvTransferParams // decode only
	crashes      bool              // the engine dies when it takes this request (vLLM #50792)
	needBlocks   int
	hash         uint64
	// byPrefix: the tokens come from tokState, the by-prefix token source's
	// (request.go), instead of hash; the scheduler folds each token in.
	byPrefix bool
	tokState uint64
	// tokens are the prompt's token ids and blockHashes the chained hashes
	// of its full blocks; both nil when the prompt's tokens are unknown (a
	// request built by a test from a count) or the prefix cache is off.
	tokens      []uint32
	blockHashes []uint64
	// key is what the prompt's blocks are keyed by beyond their tokens.
	key cacheKey
	// leg is an SGLang prefill or decode's bootstrap room (and, decode, the
	// prefiller's bootstrap server); nil for every other request. A decode's
	// remote is filled in once its room's KV is ready (sglang.go).
	leg *sglangLeg
	// transferFail: the KV transfer of this request fails (X-Sim-Transfer-Fail).
	transferFail bool
	// mc is a Mooncake decode's prefill, whose KV it claims first; its
	// remote is filled in once the prefiller has given it (mooncake.go).
	// xferID is a Mooncake prefill's transfer_id, xfer its registry entry.
	mc     *mooncakeLeg
	xferID string
	xfer   *transfer

	// scheduler
	state  reqState
	blocks []int
	// cachedTokens is how much of the prompt the prefix cache held when the
	// request was admitted; pullFrom is the first of a decode's remote
	// blocks it pulls, those before it being in its own cache.
	cachedTokens int
	pullFrom     int
	// reloadedBlocks are the blocks among cachedTokens reloaded from the CPU
	// tier, those after the GPU's.
	reloadedBlocks int
	readyAt        time.Time // prefill end, next token, or (handshaking) the handshake's end
	// handshaking: a decode admitted before its prefiller's NIXL handshake
	// is done; the scheduler orders its pull at readyAt.
	handshaking bool
	generated   int
	expiresAt   time.Time // held only: the lease's end, moved by heartbeats; zero: none (an SGLang room)
	arrived     time.Time // when the step accepted it
	// room is an SGLang prefill's bootstrap room, in the engine's registry.
	room *room
	// legEnded: an SGLang prefill's leg was answered (aborted during its
	// transfer) while its blocks stay held until the decoder's notification.
	legEnded bool

	// pulled is set by the decode's driver once its read is done, before it
	// notifies the prefiller: from then on there is no lease to renew.
	pulled atomic.Bool

	outMu sync.Mutex
	outs  []output
	ready chan struct{} // capacity 1: "outs has something"
}

type outKind uint8

const (
	outPull  outKind = iota // decode: blocks allocated, pull the KV now
	outToken                // a token; finish != "" on the last one
	outEnd                  // ended without a token: err says why
	// outReleased: a hold ended (read, aborted, expired, failed): err says
	// why, nil for a completed read. Only an SGLang prefill's handler, which
	// answers once its room's transfer is done, waits for it.
	outReleased
)

type output struct {
	kind     outKind
	index    int       // token index
	id       uint32    // token id, tokenEOS for an EOS
	text     string    // token text, "" for an EOS
	finish   string    // "length", "stop" or "" if more follow
	held     []int     // prefill ending in a hold: the held block ids, never nil then
	leaseEnd time.Time // prefill ending in a hold: when its first lease ends
	err      error     // outEnd: an *apiError, or errAborted
	crashed  bool      // outEnd: the engine died under the request, and tells nobody
	complete int       // tokens generated when this output was made
	cached   int       // outToken: prompt tokens the prefix cache held
	// pullFrom is, on outPull, the first remote block to pull: the decoder's
	// own cache holds the blocks before it.
	pullFrom int
}

func (r *request) push(o output) {
	r.outMu.Lock()
	r.outs = append(r.outs, o)
	r.outMu.Unlock()
	select {
	case r.ready <- struct{}{}:
	default:
	}
}

func (r *request) take() []output {
	r.outMu.Lock()
	defer r.outMu.Unlock()
	o := r.outs
	r.outs = nil
	return o
}

type evKind uint8

const (
	evAdd              evKind = iota
	evAbort                   // the request's own client went away (vLLM: disconnect -> abort)
	evAbortRID                // explicit /abort_request: also frees a held request
	evFinishedSending         // prefiller: a decoder read the blocks of rid and is done with them
	evFinishedReceving        // decoder: the pull of req ended, err says how
	evHeartbeat               // prefiller: a decoder renews the leases of rids
)

type event struct {
	kind evKind
	req  *request
	rid  string
	rids []string // evHeartbeat
	err  error
	// outcome is how a decoder ended an SGLang transfer (evFinishedSending):
	// "" read, outcomeFailed.
	outcome string
	// evAbortRID, SGLang: every request whose id starts with rid (all: every
	// request); matched: the abort already ended a request waiting for its
	// room, so finding nothing here is no late event.
	prefix, all, matched bool
}

// errAborted ends a request that an explicit abort or the engine's shutdown
// took away from its handler.
var errAborted = errors.New("request aborted")

// errStopped is what a request gets from an engine whose Run has ended.
var errStopped = statusError(http.StatusServiceUnavailable, "engine_stopped", "engine is shutting down")

// readsKV reports that r is a decode with blocks to read from a prefiller:
// the requests that pull, notify and renew a lease.
func (r *request) readsKV() bool {
	return r.kind == kindDecode && len(r.remote.RemoteBlockIDs) > 0
}

// lookupHashes are the block hashes a request looks up in the prefix cache:
// its full blocks short of the last token, which vLLM always computes to get
// the logits of the first output token.
func (r *request) lookupHashes(blockSize int) []uint64 {
	if r.blockHashes == nil {
		return nil
	}
	return r.blockHashes[:min(len(r.blockHashes), (r.promptTokens-1)/blockSize)]
}

func (r *request) isLive() bool {
	switch r.state {
	case stateWaiting, statePrefilling, statePulling, stateDecoding:
		return true
	}
	return false
}

// nextToken draws token i of r from its token source (request.go): its id
// and whether it is an EOS, where an EOS may end the answer.
func (r *request) nextToken(i int) (id uint32, eos bool) {
	canStop := !r.ignoreEOS && i >= r.minTokens
	if !r.byPrefix {
		return tokenID(r.hash, i), canStop && tokenIsEOS(r.hash, i)
	}
	id, eos = prefixToken(r.tokState)
	eos = eos && canStop
	if eos {
		id = tokenEOS
	}
	r.tokState = foldToken(r.tokState, id)
	return id, eos
}

// room is a bootstrap room on a prefiller. The scheduler's fields are under Engine.mu.
type room struct {
	id      uint64
	prefill *request      // nil until the prefill arrives
	ready   chan struct{} // closed once the prefill holds its KV, or the room closes
	// signalled: ready is closed; closed: the room's prefill ended (without KV, or its KV
	// was freed) or the engine stopped.
	signalled, closed bool
	// bootstrapped: a decoder was given the KV (no bootstrap timeout any more);
	// transferring: a decoder pulled it (an abort no longer frees the blocks).
	bootstrapped, transferring bool
	waiters                    int // decoders waiting in a claim
}

func (rm *room) signal() {
	if !rm.signalled {
		rm.signalled = true
		close(rm.ready)
	}
}

// transfer is a Mooncake prefill's KV on a prefiller, by transfer_id. Its fields are
// under Engine.mu.
type transfer struct {
	id      string
	prefill *request      // nil until the prefill arrives
	ready   chan struct{} // closed once the prefill holds its KV, or the transfer closes
	// signalled: ready is closed; closed: the prefill ended without KV or its hold ended.
	signalled, closed bool
	claimed           bool // a decoder was given the KV
	// released: the decode ended without the KV; its prefill frees it once held.
	released bool
	waiters  int // decoders waiting in a claim
}

func (t *transfer) signal() {
	if !t.signalled {
		t.signalled = true
		close(t.ready)
	}
}
