package proxy

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/pdproxy/pdproxy/engine"
)

// sequentialKey is a key of the P/D flow that only sequential engines (a prefill, then a decode
// carrying its params: vLLM's NixlConnector) read; paired engines (SGLang, Mooncake) send
// both legs at once and do what the key chooses their own way, said by paired.
type sequentialKey struct {
	name  string              // as in the YAML
	value func(Config) string // the key's value in a config; "" when it is not set
	def   string              // its default, which changes nothing on any engine
	// paired says what paired engines do instead, for the error that refuses the key.
	paired string
}

var sequentialKeys = []sequentialKey{
	{"decoder_reservation", func(c Config) string { return c.DecoderReservation }, ReserveBeforePrefill,
		"the decoder is reserved together with the prefiller"},
	{"abort_during_prefill", func(c Config) string { return c.AbortDuringPrefill }, AbortPrefillCancel,
		"a client leaving aborts both legs at once, the decoder's first"},
	{"kv_release", func(c Config) string { return c.KVRelease }, ReleaseDrain,
		"what the prefiller holds is freed by aborting the legs (SGLang's /abort_request) or by a drain leg (Mooncake)"},
	{"abort_during_kv_pull", func(c Config) string { return c.AbortDuringKVPull }, PullAbortImmediate,
		"a client leaving cuts the decode leg at once"},
}

// CheckEngines refuses a config that sets a key of the sequential flow (decoder_reservation,
// abort_during_prefill, kv_release, abort_during_kv_pull) to another value than its default
// while every backend, of the engine kinds given, is of a paired engine: the key would be
// accepted and never take effect. With one backend of a sequential engine, the key applies
// to its requests, and paired engines go on their own way. An unknown kind is left to the
// router to refuse.
func CheckEngines(cfg Config, kinds []string) error {
	var pairedKinds []string
	for _, k := range kinds {
		e, ok := engine.Lookup(k)
		if !ok {
			return nil
		}
		if _, p := e.(engine.Paired); !p {
			return nil
		}
		pairedKinds = append(pairedKinds, e.Kind())
	}
	if len(pairedKinds) == 0 {
		return nil
	}
	if err := cfg.Validate(); err != nil {
		// A value the key does not take is refused as such.
		return err
	}
	pairedKinds = slices.Compact(slices.Sorted(slices.Values(pairedKinds)))
	var errs []error
	for _, k := range sequentialKeys {
		if v := k.value(cfg); v != "" && v != k.def {
			errs = append(errs, fmt.Errorf("%s: %s cannot take effect: every backend is of a paired engine (%s), which sends a request's prefill and decode legs together, so %s; %s applies only to engines that run a prefill, then a decode (%s): leave it out, or set %s",
				k.name, v, strings.Join(pairedKinds, ", "), k.paired, k.name, strings.Join(sequentialKinds(), ", "), k.def))
		}
	}
	return errors.Join(errs...)
}

// sequentialKinds are the engine kinds that run a prefill, then a decode.
func sequentialKinds() []string {
	var out []string
	for _, k := range engine.Kinds() {
		if e, ok := engine.Lookup(k); ok {
			if _, s := e.(engine.Sequential); s {
				out = append(out, k)
			}
		}
	}
	return out
}
