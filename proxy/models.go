package proxy

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

	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
)

type modelList struct {
	Object string            `json:"object"`
	Data   []json.RawMessage `json:"data"`
}

// handleModels answers GET /v1/models with the models the decoders serve (every request ends
// on a decoder, so that is what a client can ask for), merged by id.
func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	body, err := s.modelList(r.Context())
	if err != nil {
		api.WriteError(w, api.NewError(api.KindNoBackend, "no decode backend answered /v1/models").With("", err, 1))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(body)
}

func (s *Server) modelList(ctx context.Context) ([]byte, error) {
	c := &s.models
	c.mu.Lock()
	if c.body != nil && time.Since(c.at) < c.fresh {
		body := c.body
		c.mu.Unlock()
		return body, nil
	}
	c.mu.Unlock()
	v, err, _ := c.group.Do("models", func() (any, error) {
		// Detached from the one caller on purpose: the answer serves every caller waiting on it.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
		defer cancel()
		body, err := s.fetchModels(ctx)
		if err != nil {
			return nil, err
		}
		c.mu.Lock()
		c.body, c.at = body, time.Now()
		c.mu.Unlock()
		return body, nil
	})
	if err != nil {
		return nil, err
	}
	return v.([]byte), nil
}

func (s *Server) fetchModels(ctx context.Context) ([]byte, error) {
	seen := map[string]bool{}
	out := modelList{Object: "list", Data: []json.RawMessage{}}
	answered := false
	for _, b := range s.router.Available(router.RoleDecode) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, pdflow.BaseURL(b)+"/v1/models", nil)
		if err != nil {
			continue
		}
		// The backend's own client: it carries the engine's API key and TLS settings. It has
		// no Timeout; ctx bounds the call (3 s, in modelList).
		resp, err := b.Client().Do(req)
		if err != nil {
			continue
		}
		raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			continue
		}
		var list modelList
		if json.Unmarshal(raw, &list) != nil {
			continue
		}
		answered = true
		for _, m := range list.Data {
			var id struct {
				ID string `json:"id"`
			}
			if json.Unmarshal(m, &id) != nil || id.ID == "" || seen[id.ID] {
				continue
			}
			seen[id.ID] = true
			out.Data = append(out.Data, m)
		}
	}
	if !answered {
		return nil, errNoModels
	}
	// Aliases are models to a client: listed once each, sorted, after the served ones.
	names := make([]string, 0, len(s.aliases))
	for name := range s.aliases {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if seen[name] {
			continue
		}
		m, err := json.Marshal(struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Created int64  `json:"created"`
			OwnedBy string `json:"owned_by"`
		}{name, "model", time.Now().Unix(), "pdproxy"})
		if err == nil {
			out.Data = append(out.Data, m)
		}
	}
	return json.Marshal(out)
}

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

// resolveModel turns the model a client named into the one the engines serve: an alias's
// pick, else the name itself. A model that no decoder serves is a 404, when every decoder's
// models are known (configured, or listed by its engine); while some are not, the request
// goes on and the engine answers for itself. label is the request's model label
// (modelLabel), from the same look at the models.
func (s *Server) resolveModel(name string) (served, label string, e *api.Error) {
	served, label = name, "other"
	models, complete := s.router.Models(router.RoleDecode)
	if p := s.aliases[name]; p != nil {
		served, label = p.pick(), name
	} else if slices.Contains(models, name) {
		label = name
	}
	if complete && !slices.Contains(models, served) {
		return "", label, modelNotFound(name)
	}
	return served, label, nil
}

// resolveModel resolves the request's model (resolveModel): an alias's body is rewritten to
// the served model, and the answer renamed back.
func (s *Server) resolveRequestModel(x *pdflow.Exchange) *api.Error {
	served, label, e := s.resolveModel(x.Req.Model)
	x.Names.Label = label
	if e != nil {
		return e
	}
	if served == x.Req.Model {
		return nil
	}
	v, _ := json.Marshal(served)
	f, err := x.Req.Fields.With("model", v)
	if err != nil {
		return pdflow.BuildFailed(err, "engine")
	}
	x.Names.Client, x.Req.Model, x.Req.Fields = x.Req.Model, served, f
	x.Names.Rename = api.NewRenamer(served, x.Names.Client)
	return nil
}

// modelLabel is the model label of a request's metrics: the name the client used when it is
// an alias or a model a decoder serves, else "other", so that clients naming random models
// cannot grow the label set. A request whose model was resolved has it already (x.label).
func (s *Server) modelLabel(name string) string {
	if name == "" {
		return ""
	}
	if _, ok := s.aliases[name]; ok {
		return name
	}
	if models, _ := s.router.Models(router.RoleDecode); slices.Contains(models, name) {
		return name
	}
	return "other"
}
