package sim

import (
	"fmt"
	"net/http"
)

// Served models, as a vLLM server started with --served-model-name a,b and
// --lora-modules name=path serves them: Config.Model lists the names
// (comma-separated; the first is the default, what a request without a model
// gets and the model_name label of /metrics), Config.LoRAModules the
// adapters, which /v1/models lists with the first model as their parent. A
// generation or pooling request naming anything else gets vLLM's 404
// (OpenAIServing._check_model): {"error":{"message":"The model `X` does not
// exist.","type":"NotFoundError","param":"model","code":404}}.

// cacheKeyOf is what the prompt of a request of a is keyed by beyond its tokens: the
// adapter it names, if it names one, and its cache_salt.
func (e *Engine) cacheKeyOf(a *apiRequest) cacheKey {
	k := cacheKey{salt: a.cacheSalt}
	for i, l := range e.loras {
		if l.name == a.model {
			k.lora, k.loraID = l.name, i+1
		}
	}
	return k
}

// defaultModel is the first served model name.
func (e *Engine) defaultModel() string { return e.models[0] }

// resolveModel is the model a request names: the default when it names
// none, as vLLM does, and vLLM's 404 when this engine serves no such model
// or adapter.
func (e *Engine) resolveModel(name string) (string, error) {
	if name == "" {
		return e.defaultModel(), nil
	}
	for _, m := range e.models {
		if m == name {
			return name, nil
		}
	}
	for _, l := range e.loras {
		if l.name == name {
			return name, nil
		}
	}
	return "", modelNotFound(name)
}

func modelNotFound(name string) *apiError {
	return &apiError{Status: http.StatusNotFound, Type: "NotFoundError", Param: "model", numeric: true,
		Message: fmt.Sprintf("The model `%s` does not exist.", name)}
}

func (e *Engine) handleModels(w http.ResponseWriter, _ *http.Request) {
	type model struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
	}
	now := e.clock.Now().Unix()
	var data []model
	for _, m := range e.models {
		data = append(data, model{ID: m, Object: "model", Created: now, OwnedBy: "pdproxy-sim", Root: m, MaxModelLen: e.maxModelLen()})
	}
	for _, l := range e.loras {
		parent := e.defaultModel()
		data = append(data, model{ID: l.name, Object: "model", Created: now, OwnedBy: "pdproxy-sim", Root: l.path, Parent: &parent, MaxModelLen: e.maxModelLen()})
	}
	writeJSON(w, http.StatusOK, struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: data})
}

// checkPriority refuses a nonzero priority without the priority policy,
// with the message vLLM's engine raises (a ValueError: its 400).
func (e *Engine) checkPriority(priority int) error {
	if priority != 0 && e.cfg.SchedulingPolicy != SchedulingPriority {
		return &apiError{Status: http.StatusBadRequest, Type: "BadRequestError", numeric: true,
			Message: fmt.Sprintf("Got priority %d but Priority scheduling is not enabled.", priority)}
	}
	return nil
}

// maxModelLen is the longest prompt this engine takes: MaxModelLen, or
// what the whole pool holds.
func (e *Engine) maxModelLen() int {
	pool := e.cfg.KVBlocks * e.cfg.BlockSize
	if e.cfg.MaxModelLen > 0 {
		return min(e.cfg.MaxModelLen, pool)
	}
	return pool
}
