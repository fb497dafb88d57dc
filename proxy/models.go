package proxy

// The models clients name: the model aliases (model_aliases) and their picks, and the cache
// of the decoders' model list that GET /v1/models answers from (modellist.go).

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/api"
)

// Alias is what a client-facing model name stands for: one served model, or several split
// by weight (a canary). In YAML it is a model name, or a list of {model, weight}.
type Alias []AliasTarget

// AliasTarget is one served model an alias sends requests to.
type AliasTarget struct {
	// Model is the served model's name, as the engines list it.
	Model string `yaml:"model"`
	// Weight is the target's share of the alias's requests, relative to the others'. Absent
	// means 1; 0 sends it nothing (a canary turned off).
	Weight *int `yaml:"weight"`
}

// UnmarshalYAML takes a model name for an alias of one target.
func (a *Alias) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		var m string
		if err := n.Decode(&m); err != nil {
			return err
		}
		*a = Alias{{Model: m}}
		return nil
	}
	var ts []AliasTarget
	if err := n.Decode(&ts); err != nil {
		return fmt.Errorf("a model alias is a model name or a list of {model, weight}: %w", err)
	}
	*a = ts
	return nil
}

func (t AliasTarget) weight() int {
	if t.Weight == nil {
		return 1
	}
	return *t.Weight
}

// validateAliases checks model_aliases: every alias names served models (not other aliases),
// with weights that send it something.
func validateAliases(aliases map[string]Alias) error {
	for name, a := range aliases {
		f := fmt.Sprintf("model_aliases.%s", name)
		if strings.TrimSpace(name) == "" {
			return fmt.Errorf("model_aliases: an alias has an empty name")
		}
		if len(a) == 0 {
			return fmt.Errorf("%s: names no model", f)
		}
		total := 0
		for i, t := range a {
			switch {
			case strings.TrimSpace(t.Model) == "":
				return fmt.Errorf("%s[%d].model: empty", f, i)
			case t.weight() < 0:
				return fmt.Errorf("%s[%d].weight: %d is negative", f, i, t.weight())
			}
			if _, chained := aliases[t.Model]; chained && t.Model != name {
				return fmt.Errorf("%s[%d].model: %q is itself an alias; name a served model", f, i, t.Model)
			}
			total += t.weight()
		}
		if total == 0 {
			return fmt.Errorf("%s: every weight is 0, so the alias would serve nothing", f)
		}
	}
	return nil
}

// aliasPicker splits one alias's requests across its targets by smooth weighted round robin
// (nginx's): over every run of total-weight requests each target gets exactly its weight,
// interleaved rather than in blocks, so a canary's share holds over a few hundred requests
// and not only on average.
type aliasPicker struct {
	mu      sync.Mutex
	targets []AliasTarget
	current []int
	total   int
}

func newAliasPicker(a Alias) *aliasPicker {
	p := &aliasPicker{targets: a, current: make([]int, len(a))}
	for _, t := range a {
		p.total += t.weight()
	}
	return p
}

func (p *aliasPicker) pick() string {
	if len(p.targets) == 1 {
		return p.targets[0].Model
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	best := -1
	for i, t := range p.targets {
		if t.weight() == 0 {
			continue
		}
		p.current[i] += t.weight()
		if best < 0 || p.current[i] > p.current[best] {
			best = i
		}
	}
	p.current[best] -= p.total
	return p.targets[best].Model
}

// modelNotFound is a request for a model that no decoder serves and no alias names.
func modelNotFound(model string) *api.Error {
	return api.NewError(api.KindModelNotFound, fmt.Sprintf("The model %q does not exist or is not served here; GET /v1/models lists those that are.", model)).With("model", nil, 0)
}

// defaultModelsCacheFreshness is how long GET /v1/models answers from its cache.
const defaultModelsCacheFreshness = 5 * time.Second

// modelCache keeps the merged model list of the decoders for a few seconds, and makes
// concurrent /v1/models calls share one round of backend calls.
type modelCache struct {
	fresh time.Duration
	group singleflight.Group
	mu    sync.Mutex
	at    time.Time
	body  []byte
}
