package router

import (
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Hint carries what a policy and the wait queue may use about a request. Only Class, a
// name from the proxy's config, reaches a metric label.
type Hint struct {
	// RequestID identifies the request in logs.
	RequestID string
	// Prefix is the start of the prompt, for prefix_affinity; empty means no affinity.
	Prefix string
	// Text is the whole prompt as it repeats across a session's turns, for cache_aware: a
	// completion's prompt, or a chat's messages array as the client sent it (its JSON
	// grows at the end turn after turn, as the rendered conversation does). Empty means
	// the cache-aware policies pick the least in flight and record nothing.
	Text string
	// Tokens are the prompt's token ids as the engines tokenize it (Router.Tokens), for
	// precise_cache_aware; nil means it scores the request by Text alone.
	Tokens []uint32
	// LoRA and CacheSalt are what the engines key the prompt's KV blocks by beyond its
	// tokens (kvcache.Identity): the LoRA adapter the request names (Model, when the
	// engines serve it as an adapter: Router.Adapter), and its cache_salt. precise_cache_aware
	// matches Tokens only against blocks stored under the same two; empty means the base
	// model, unsalted.
	LoRA, CacheSalt string
	// Model is the model the request names, as the engines serve it (an alias resolved):
	// only backends that serve it (Backend.Serves) are picked, and a request for a model
	// no backend serves waits for none. Empty means any backend.
	Model string
	// Exclude names backends not to pick, e.g. the ones a retry already tried.
	Exclude []string
	// Session is an opaque key of the session the request belongs to (what the proxy read
	// from a session header); empty means none. A request of a session goes to the engine
	// the session is bound to (Bound) while that engine may take it, else to where the
	// session's key is placed (see SessionChoice), whatever the policy: every replica then
	// sends a session's turns to one engine. The key reaches no log or label.
	Session string
	// Bound is the name of the engine of this role the session was bound to, from state the
	// replicas share; empty means none, and the session is placed by its key alone.
	Bound string
	// BoundText is how many leading bytes of Text the session's latest request sent Bound,
	// from the same state; zero means unknown. The cost policies credit Bound with holding
	// them, whichever replica routed that request.
	BoundText int
	// Placed is where the heads of Text were last sent by any replica, from state the
	// replicas share (Router.Heads); cache_aware credits each engine named with its head,
	// as it credits the text this replica routed. Empty means none known.
	Placed []Placement
	// Sent is the uncached prompt tokens every replica sent each engine named lately, from
	// the same state (Router.SpreadEngines): a pool that spreads prompts no engine holds by
	// what was sent each engine weighs the larger of this and what this replica sent.
	Sent map[string]float64
	// Accept, when set, restricts the pick to backends whose engine it accepts: one request
	// never mixes engines that speak different protocols.
	Accept func(routerconfig.Engine) bool
	// Overcommit lets the pick go past max_inflight instead of waiting. It is for the
	// proxy's own release traffic (a one-token drain that makes a decoder pull and free a
	// prefiller's KV): that must never queue behind the load whose memory it frees.
	Overcommit bool
	// waited is how long the request has waited in the queue when a dispatch picks for it:
	// the TTFT bound counts it as part of the time to first token.
	waited time.Duration
	// admit, when set, decides whether a pick by cost is taken (the pool's TTFT bound): a
	// policy asks it before it records anything of the pick (holds).
	admit func(Cost) bool
	// Class names the request's priority class, from the proxy's config (a closed set): the
	// class label of pdproxy_queue_wait_seconds. Empty shows as "none".
	Class string
	// Slack is how long the request may wait in the queue before nothing that arrives later
	// is served ahead of it: the queue serves the earliest deadline first, a waiter's
	// deadline being its arrival plus its Slack. Zero, the default for every request, makes
	// the queue first come, first served; a batch class with a Slack of seconds lets
	// interactive requests (Slack 0) overtake it for that long, and no longer, so none
	// starves. It orders the request within its Flow.
	Slack time.Duration
	// Flow is the tenant the request waits for, if it waits: the queue serves flows by
	// weight (flow.go). Its zero value is the one flow of requests that name none.
	Flow Flow
	// MaxWait is the longest the request may wait in the queue before ErrQueueTimeout. Zero
	// means the pool's queue.timeout.
	MaxWait time.Duration
}

// holds reports whether a pick of cost for h is held back (admit refuses it).
func (h Hint) holds(c Cost) bool { return h.admit != nil && !h.admit(c) }

// heldCost is the Cost of a pick held back.
var heldCost = Cost{held: true}
