package proxy

// The front's steps of a request, each a Server method over its pdflow.Exchange, made before
// the flow serves it: the prefiller its header names (the sidecar slot), its session read and
// the engines its picks went to bound, and its model resolved (an alias's pick).

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// namePrefiller reads the prefiller the request's header names, in the sidecar mode: x.named
// is its backend, nil when the request names none. A value that is no host:port is a 400, one
// the allowlist does not cover a 403; neither reaches an engine.
func (s *Server) namePrefiller(x *pdflow.Exchange) *api.Error {
	sc := s.sidecar
	values := x.R.Header.Values(sc.header)
	p, named, err := parsePrefillerHeader(values)
	if err != nil {
		s.refusePrefiller(x, refusedMalformed, values, err)
		return api.NewError(api.KindInvalidPrefiller, sc.header+" must name a prefiller as host:port: "+err.Error()).With(sc.header, err, 0)
	}
	if !named {
		return nil
	}
	if !sc.allow.allows(p) {
		s.refusePrefiller(x, refusedNotAllowed, values, nil)
		return api.NewError(api.KindPrefillerNotAllowed, "the prefiller "+sc.header+" names is not one this proxy may call (prefiller_allow)").With(sc.header, nil, 0)
	}
	b, err := router.NewDetached(routerconfig.BackendConfig{URL: "http://" + p.hostPort(), Role: routerconfig.RolePrefill}, sc.engine, sc.client)
	if err != nil {
		// parsePrefillerHeader let through only what makes a URL.
		return api.NewError(api.KindInternal, "could not address the prefiller").With("", err, 0)
	}
	x.Legs.Named = b
	return nil
}

func (s *Server) refusePrefiller(x *pdflow.Exchange, reason string, values []string, err error) {
	s.m.PrefillerRefused.WithLabelValues(reason).Inc()
	v := strings.Join(values, ", ")
	if len(v) > 256 {
		v = v[:256] + "..."
	}
	fields := []zap.Field{zap.String("request_id", x.ID), zap.String("reason", reason), zap.String("header", s.sidecar.header), zap.String("value", v)}
	if err != nil {
		fields = append(fields, zap.Error(err))
	}
	s.logger.Warn("prefiller header refused", fields...)
}

// picked records where a pick for role went, for a request of a session: counted, and, with
// shared state, the session bound to that engine for the TTL from now (a binding kept is
// renewed).
func (s *Server) picked(x *pdflow.Exchange, role routerconfig.Role, lease *router.Lease) {
	choice := lease.Session()
	if choice == "" {
		return
	}
	s.m.SessionPicks.WithLabelValues(string(role), string(choice)).Inc()
	if s.shared != nil {
		ttl := s.cfg.SessionAffinity.TTL
		s.shared.Bind(x.Sess.Key, string(role), lease.Backend().Name, ttl)
		if text := x.HintText(role); text != "" {
			s.shared.Bind(x.Sess.Key, textField(role), strconv.Itoa(len(text)), ttl)
		}
	}
}

// readSession reads the session the request names in the first of headers it carries, before
// its body: a session header that cannot be an id refuses the request.
func (s *Server) readSession(x *pdflow.Exchange, headers []string) *api.Error {
	key, e := sessionOf(x.R, headers)
	if e != nil || key == "" {
		return e
	}
	x.Sess.Key = key
	if s.shared == nil {
		return nil // the key alone places the session
	}
	b := map[string]string(nil)
	if a := admissionOf(x.R.Context()); a != nil && a.read {
		b = a.bindings
	} else {
		// No limits' check read them: one round trip of its own, within the shared state's
		// budget. When it fails (counted there), the key alone places the session.
		d, err := s.shared.Check(x.R.Context(), sharedstate.Request{SessionKeys: []string{key}})
		if err != nil {
			return nil
		}
		b = d.Bindings[key]
	}
	x.Sess.Prefill, x.Sess.Decode = b[string(routerconfig.RolePrefill)], b[string(routerconfig.RoleDecode)]
	x.Sess.PrefillText, x.Sess.DecodeText = boundBytes(b[textField(routerconfig.RolePrefill)]), boundBytes(b[textField(routerconfig.RoleDecode)])
	return nil
}

// resolveModel turns the model a client named into the one the engines serve: an alias's
// pick, else the name itself. A model that no decoder serves is a 404, when every decoder's
// models are known (configured, or listed by its engine); while some are not, the request
// goes on and the engine answers for itself. label is the request's model label
// (modelLabel), from the same look at the models.
func (s *Server) resolveModel(name string) (served, label string, e *api.Error) {
	served, label = name, "other"
	models, complete := s.router.Models(routerconfig.RoleDecode)
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
	if models, _ := s.router.Models(routerconfig.RoleDecode); slices.Contains(models, name) {
		return name
	}
	return "other"
}
