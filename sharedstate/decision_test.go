package sharedstate

import (
	"testing"
	"time"
)

func TestDecisionRefusesAnswersOfAnotherShape(t *testing.T) {
	sessions := []string{"s1"}
	none := []any{[]any{}}
	for name, res := range map[string][]any{
		"allowed as the string 1":       {"1", "", int64(0), none},
		"allowed 2":                     {int64(2), "", int64(0), none},
		"reason as an integer":          {int64(0), int64(1), int64(0), none},
		"refused with no reason":        {int64(0), "", int64(0), none},
		"refused for a reason unknown":  {int64(0), "quota", int64(0), none},
		"allowed with a reason":         {int64(1), "rate", int64(0), none},
		"retry as a string":             {int64(0), "rate", "1000", none},
		"retry negative":                {int64(0), "rate", int64(-1), none},
		"bindings not a list":           {int64(1), "", int64(0), "x"},
		"a binding per session short":   {int64(1), "", int64(0), []any{}},
		"a binding of odd length":       {int64(1), "", int64(0), []any{[]any{"decode"}}},
		"a binding's engine an integer": {int64(1), "", int64(0), []any{[]any{"decode", int64(3)}}},
		"three values":                  {int64(1), "", int64(0)},
	} {
		t.Run(name, func(t *testing.T) {
			if d, err := decision(res, sessions); err == nil {
				t.Errorf("decision(%v) = %+v, want an error: an answer that cannot be read is Redis failing", res, d)
			}
		})
	}
	for name, tc := range map[string]struct {
		res  []any
		want Decision
	}{
		"allowed, bound": {[]any{int64(1), "", int64(0), []any{[]any{"decode", "d1", "prefill", "p0"}}},
			Decision{Allowed: true, Bindings: map[string]map[string]string{"s1": {"decode": "d1", "prefill": "p0"}}}},
		"refused by rate":        {[]any{int64(0), ReasonRate, int64(2500), none}, Decision{Reason: ReasonRate, RetryAfter: 2500 * time.Microsecond}},
		"refused by concurrency": {[]any{int64(0), ReasonConcurrency, int64(0), none}, Decision{Reason: ReasonConcurrency, RetryAfter: time.Second}},
	} {
		t.Run(name, func(t *testing.T) {
			d, err := decision(tc.res, sessions)
			if err != nil || d.Allowed != tc.want.Allowed || d.Reason != tc.want.Reason || d.RetryAfter != tc.want.RetryAfter ||
				len(d.Bindings) != len(tc.want.Bindings) || d.Bindings["s1"]["decode"] != tc.want.Bindings["s1"]["decode"] || d.Bindings["s1"]["prefill"] != tc.want.Bindings["s1"]["prefill"] {
				t.Errorf("decision(%v) = %+v, %v; want %+v", tc.res, d, err, tc.want)
			}
		})
	}
}
