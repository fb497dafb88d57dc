package proxy

import (
	"bytes"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
)

// PriorityConfig maps requests to priority classes. A class orders the router's wait queue
// when every engine is at max_inflight: earliest deadline first, a request's deadline being
// its arrival plus its class's max_queue_wait, so a class of slack is overtaken by those of
// less for at most that long, and never starved. A request's class is the one the header
// names (an unknown name is a 400), else the one whose priority equals the body's
// priority, else the default class.
//
// The body's priority (vLLM's, read by --scheduling-policy priority: lower runs earlier;
// SGLang's with --enable-priority-scheduling) goes to the engines on both legs of a P/D
// request, untouched unless its class has set_priority.
type PriorityConfig struct {
	// Header names a request header whose value names the request's class (e.g.
	// X-Priority: batch), matched exactly. It is not passed on to engines. Empty means the
	// class comes from the body's priority alone.
	Header string `yaml:"header"`
	// Classes are the classes, in any order. Empty, the default, means no classes: the queue
	// is first come, first served, and every request's class shows as none.
	Classes []PriorityClass `yaml:"classes"`
	// DefaultClass names the class of a request that names none. [the first class]
	DefaultClass string `yaml:"default_class"`
}

// PriorityClass is one class of requests.
type PriorityClass struct {
	// Name is the class's name, the header's value and the class label of the metrics:
	// lowercase letters, digits, _ and -, at most 32; "none" is taken.
	Name string `yaml:"name"`
	// Priority is the engines' priority of the class (lower runs earlier): a body whose
	// priority equals it is of this class. Distinct for each class; [0].
	Priority int `yaml:"priority"`
	// MaxQueueWait is the class's slack in the proxy's wait queue: how long a request of it
	// may be overtaken by requests of less slack that arrive after it. It does not end the
	// wait (queue.timeout does). [0: served in arrival order with every class of 0]
	MaxQueueWait time.Duration `yaml:"max_queue_wait"`
	// SetPriority writes Priority into the body sent to the engines when the client sent no
	// priority (or null), so that an engine scheduling by priority orders it by its class
	// too, and bounds what the body may claim: a body priority below Priority (which would
	// run it earlier) becomes Priority; one above it is kept. [false: the body goes as it
	// came]
	SetPriority bool `yaml:"set_priority"`
}

var className = regexp.MustCompile(`^[a-z0-9_-]{1,32}$`)

func (c *PriorityConfig) setDefaults() error {
	if len(c.Classes) == 0 {
		if c.Header != "" || c.DefaultClass != "" {
			return fmt.Errorf("priority: header and default_class need classes")
		}
		return nil
	}
	names, prios := map[string]bool{}, map[int]bool{}
	for i, cl := range c.Classes {
		switch {
		case !className.MatchString(cl.Name) || cl.Name == "none" || cl.Name == "other":
			return fmt.Errorf("priority.classes[%d].name: %q is not 1 to 32 of a-z, 0-9, _ and -, or is a reserved name (none, other)", i, cl.Name)
		case names[cl.Name]:
			return fmt.Errorf("priority.classes[%d].name: %q is used twice", i, cl.Name)
		case prios[cl.Priority]:
			return fmt.Errorf("priority.classes[%d].priority: %d is another class's too", i, cl.Priority)
		case cl.MaxQueueWait < 0:
			return fmt.Errorf("priority.classes[%d].max_queue_wait: %v is negative", i, cl.MaxQueueWait)
		}
		names[cl.Name], prios[cl.Priority] = true, true
	}
	if c.DefaultClass == "" {
		c.DefaultClass = c.Classes[0].Name
	}
	if !names[c.DefaultClass] {
		return fmt.Errorf("priority.default_class: %q names no class", c.DefaultClass)
	}
	return nil
}

// classes are the configured classes, looked up per request.
type classes struct {
	header     string
	byName     map[string]*PriorityClass
	byPriority map[int64]*PriorityClass
	def        *PriorityClass
}

// newClasses builds the lookup for cfg (defaults set); nil when no class is configured.
func newClasses(cfg PriorityConfig) *classes {
	if len(cfg.Classes) == 0 {
		return nil
	}
	c := &classes{byName: map[string]*PriorityClass{}, byPriority: map[int64]*PriorityClass{}}
	if cfg.Header != "" {
		c.header = http.CanonicalHeaderKey(cfg.Header)
	}
	for i := range cfg.Classes {
		cl := &cfg.Classes[i]
		c.byName[cl.Name], c.byPriority[int64(cl.Priority)] = cl, cl
	}
	c.def = c.byName[cfg.DefaultClass]
	return c
}

// classify finds req's class and, when the class says so, writes its priority into the
// body. It returns nil (no class) when no class is configured.
func (c *classes) classify(r *http.Request, req *api.Request) (*PriorityClass, *api.Error) {
	if c == nil {
		return nil, nil
	}
	prio, sent, e := api.CountField(req.Fields, "priority", math.MinInt64)
	if e != nil {
		return nil, e
	}
	cl := c.def
	if v := strings.TrimSpace(r.Header.Get(c.header)); c.header != "" && v != "" {
		named, ok := c.byName[v]
		if !ok {
			names := make([]string, 0, len(c.byName))
			for n := range c.byName {
				names = append(names, n)
			}
			slices.Sort(names)
			return nil, api.BadRequest(c.header, fmt.Sprintf("%s names no priority class; the classes are %s", c.header, strings.Join(names, ", ")))
		}
		cl = named
	} else if sent {
		if byPrio, ok := c.byPriority[prio]; ok {
			cl = byPrio
		}
	}
	if cl.SetPriority && (!sent || prio < int64(cl.Priority)) {
		var fields *engine.Fields
		var err error
		if sent {
			// A body may rank its request lower than its class (a larger number), never
			// ahead of it: the engines would serve a batch request before interactive ones.
			fields, err = req.Fields.With("priority", []byte(strconv.Itoa(cl.Priority)))
		} else {
			fields, err = withMember(req.Fields, "priority", strconv.Itoa(cl.Priority))
		}
		if err != nil {
			return nil, api.NewError(api.KindInternal, "internal error").With("", err, 0)
		}
		req.Fields = fields
	}
	return cl, nil
}

// withMember is f's body with one more member, last, so that it wins over one of the same
// key (a null) as every JSON reader the engines use takes the last.
func withMember(f *engine.Fields, key, val string) (*engine.Fields, error) {
	body, err := engine.DecodeBody(f, nil) // the client's body, less its own kv_transfer_params
	if err != nil {
		return nil, err
	}
	end := bytes.LastIndexByte(body, '}')
	out := make([]byte, 0, len(body)+len(key)+len(val)+4)
	out = append(out, body[:end]...)
	if head := bytes.TrimSpace(body[:end]); head[len(head)-1] != '{' {
		out = append(out, ',')
	}
	out = append(out, '"')
	out = append(out, key...)
	out = append(out, `":`...)
	out = append(out, val...)
	out = append(out, body[end:]...)
	return engine.ParseFields(out)
}
