package proxy

// GET /v1/models: the models the decoders serve, merged by id and kept a few seconds
// (modelCache), with the model aliases listed after them.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router/routerconfig"
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
	for _, b := range s.router.Available(routerconfig.RoleDecode) {
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

var errNoModels = errors.New("no backend answered /v1/models")
