package router

import (
	"slices"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Models returns every model a backend of role serves, sorted, each once (shared: the caller
// must not modify it), and whether that is all of them: false while a backend's models are
// unknown (its engine has not answered /v1/models yet), when a model absent from the list
// may still be served. A discover entry's configured models count even before its name
// resolves.
//
// Every request asks it: the answer is kept until a backend's models, the backends or the
// discover entries change (forgetModels).
func (r *Router) Models(role routerconfig.Role) (models []string, complete bool) {
	views := r.modelViews.Load()
	if gen := r.modelGen.Load(); views == nil || views.gen != gen {
		// Read the generation before the state: a change while this runs makes the next
		// call work it out again.
		views = &modelViews{gen: gen, v: [2]modelView{r.modelsOf(routerconfig.RolePrefill), r.modelsOf(routerconfig.RoleDecode)}, adapters: r.adaptersOf()}
		r.modelViews.Store(views)
	}
	if role == routerconfig.RoleDecode {
		return views.v[1].models, views.v[1].complete
	}
	return views.v[0].models, views.v[0].complete
}

// Adapter reports whether an engine of either role serves model as a LoRA adapter (its
// /v1/models lists it with a parent): a request for it is of that adapter, whose KV blocks
// the engines key by its name (Hint.LoRA). A model no engine lists so, configured models
// among them, is taken for a base model.
func (r *Router) Adapter(model string) bool {
	if model == "" {
		return false
	}
	r.Models(routerconfig.RolePrefill) // brings the views up to date
	views := r.modelViews.Load()
	return views != nil && views.adapters[model]
}

// modelViews are Models' answers for prefill and decode, as of generation gen, and the
// models served as LoRA adapters.
type modelViews struct {
	gen      uint64
	v        [2]modelView
	adapters map[string]bool
}

// modelView is what Models answers for one role.
type modelView struct {
	models   []string
	complete bool
}

// forgetModels makes the answers Models keeps stale, after what they were made of changed.
func (r *Router) forgetModels() { r.modelGen.Add(1) }

// adaptersOf is the models some backend serves as LoRA adapters; nil for none.
func (r *Router) adaptersOf() map[string]bool {
	var out map[string]bool
	for _, b := range r.backends() {
		if b.st.removed.Load() {
			continue
		}
		if p := b.st.served.adapters.Load(); p != nil {
			for _, m := range *p {
				if out == nil {
					out = make(map[string]bool)
				}
				out[m] = true
			}
		}
	}
	return out
}

// modelsOf is Models, worked out.
func (r *Router) modelsOf(role routerconfig.Role) modelView {
	var models []string
	complete := true
	seen := map[string]bool{}
	for _, t := range r.disc.entryTemplates() {
		if t.Role != role {
			continue
		}
		for _, m := range t.Models {
			if !seen[m] {
				seen[m] = true
				models = append(models, m)
			}
		}
	}
	for _, b := range r.backends() {
		if b.Role != role || b.st.removed.Load() {
			continue
		}
		ms := b.Models()
		if ms == nil {
			complete = false
		}
		for _, m := range ms {
			if !seen[m] {
				seen[m] = true
				models = append(models, m)
			}
		}
	}
	slices.Sort(models)
	return modelView{models, complete}
}
