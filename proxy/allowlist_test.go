package proxy

import (
	"net/netip"
	"strings"
	"testing"
)

func TestPrefillerAllowlistMatching(t *testing.T) {
	a, err := parseAllowlist([]string{
		"10.0.0.0/8",
		"fd00:1::/32",
		"192.168.1.5:8000",
		"192.168.1.6:*",
		"[fd00:2::5]:8200",
		"vllm-prefill-*.llm.svc.cluster.local:8000",
		"prefill-*-gpu.Other.Svc.:*",
	})
	if err != nil {
		t.Fatalf("parseAllowlist: %v", err)
	}
	for _, tc := range []struct {
		header string
		want   bool
	}{
		{"10.1.2.3:8000", true},
		{"10.255.255.255:1", true},
		{"11.0.0.1:8000", false},
		{"[::ffff:10.1.2.3]:8000", true}, // an IPv4-mapped IPv6 address is the IPv4 address
		{"[fd00:1:abcd::7]:8000", true},
		{"[fd00:2::7]:8000", false},
		{"192.168.1.5:8000", true},
		{"192.168.1.5:8001", false}, // an IP:port allows that port only
		{"192.168.1.6:9999", true},
		{"[fd00:2::5]:8200", true},
		{"[fd00:2::5]:8000", false},
		{"vllm-prefill-0.llm.svc.cluster.local:8000", true},
		{"VLLM-Prefill-17.LLM.svc.cluster.local.:8000", true}, // DNS names are case-blind; a trailing dot is the same name
		{"vllm-prefill-0.llm.svc.cluster.local:8001", false},
		{"vllm-prefill-0.evil.llm.svc.cluster.local:8000", false}, // * never crosses a dot
		{"vllm-prefill-0.other.svc.cluster.local:8000", false},
		{"vllm-decode-0.llm.svc.cluster.local:8000", false},
		{"prefill-a-gpu.other.svc:1234", true},
		{"prefill-a.b-gpu.other.svc:1234", false},
		{"localhost:8000", false},
	} {
		t.Run(tc.header, func(t *testing.T) {
			p, named, err := parsePrefillerHeader([]string{tc.header})
			if err != nil || !named {
				t.Fatalf("parsePrefillerHeader(%q) = %+v, %v, %v", tc.header, p, named, err)
			}
			if got := a.allows(p); got != tc.want {
				t.Errorf("allows(%q) = %v, want %v", tc.header, got, tc.want)
			}
		})
	}
}

func TestPrefillerAllowlistAllowsNothingEmpty(t *testing.T) {
	var a allowlist
	for _, h := range []string{"10.0.0.1:8000", "[::1]:8000", "a.b:1"} {
		p, _, err := parsePrefillerHeader([]string{h})
		if err != nil {
			t.Fatal(err)
		}
		if a.allows(p) {
			t.Errorf("an empty allowlist allows %s", h)
		}
	}
}

func TestPrefillerAllowlistRefusesEntriesItCannotReadPlainly(t *testing.T) {
	for _, tc := range []struct {
		entry, want string
	}{
		{"10.0.0.5/8", "10.0.0.0/8"}, // host bits set: it may as well have meant /32
		{"10.0.0.0/33", "want a CIDR"},
		{"10.0.0.5", "want a CIDR"}, // an address alone: a /32 or an IP:port says which
		{"vllm-prefill-0.ns.svc", "want a CIDR"},
		{"vllm-prefill-0.ns.svc:0", "port"},
		{"vllm-prefill-0.ns.svc:65536", "port"},
		{"vllm-prefill-0.ns.svc:http", "port"},
		{"vllm_prefill.ns.svc:8000", "letters, digits and hyphens"},
		{"a..b:8000", "letters, digits and hyphens"},
		{"10.0.0.*:8000", "10.0.0.0/24"}, // addresses as text would miss their other spellings
		{"[fe80::1%eth0]:8000", "zone"},
		{"fe80::1%eth0/64", "want a CIDR"},
		{":8000", "want a CIDR"},
		{"", "want a CIDR"},
	} {
		t.Run(tc.entry, func(t *testing.T) {
			_, err := parseAllowlist([]string{"10.0.0.0/8", tc.entry})
			if err == nil {
				t.Fatalf("parseAllowlist accepted %q", tc.entry)
			}
			if !strings.Contains(err.Error(), "prefiller_allow[1]") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not name prefiller_allow[1] and say %q", err, tc.want)
			}
		})
	}
}

func TestPrefillerHeaderParsing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values []string
		named  bool
		want   string // hostPort when named
		bad    bool
	}{
		{name: "no header names no prefiller", values: nil},
		{name: "an empty header names none: llm-d's scheduler clears it when it chose no prefill", values: []string{""}},
		{name: "blank", values: []string{"  "}},
		{name: "ip:port as llm-d's scheduler writes it", values: []string{"10.0.0.7:8000"}, named: true, want: "10.0.0.7:8000"},
		{name: "IPv6 in brackets", values: []string{"[fd00::7]:8000"}, named: true, want: "[fd00::7]:8000"},
		{name: "IPv6 in a long form comes out canonical", values: []string{"[FD00:0:0::7]:8000"}, named: true, want: "[fd00::7]:8000"},
		{name: "an IPv4-mapped address is the IPv4 address", values: []string{"[::ffff:10.0.0.7]:8000"}, named: true, want: "10.0.0.7:8000"},
		{name: "a DNS name", values: []string{"Vllm-Prefill-0.ns.svc.:8000"}, named: true, want: "vllm-prefill-0.ns.svc:8000"},
		{name: "the older http:// form", values: []string{"http://10.0.0.7:8000"}, named: true, want: "10.0.0.7:8000"},
		{name: "the first of a comma-separated list", values: []string{" 10.0.0.7:8000 , 10.0.0.8:8000"}, named: true, want: "10.0.0.7:8000"},
		{name: "the first of several lines", values: []string{"10.0.0.7:8000", "10.0.0.8:8000"}, named: true, want: "10.0.0.7:8000"},
		{name: "an empty first value names none, as in llm-d", values: []string{", 10.0.0.8:8000"}},
		{name: "no port", values: []string{"10.0.0.7"}, bad: true},
		{name: "port 0", values: []string{"10.0.0.7:0"}, bad: true},
		{name: "port too large", values: []string{"10.0.0.7:65536"}, bad: true},
		{name: "a named port", values: []string{"10.0.0.7:http"}, bad: true},
		{name: "a signed port", values: []string{"10.0.0.7:+80"}, bad: true},
		{name: "IPv6 without brackets", values: []string{"fd00::7:8000"}, bad: true},
		{name: "an IPv6 zone", values: []string{"[fe80::1%eth0]:8000"}, bad: true},
		{name: "https: the prefiller is reached over http", values: []string{"https://10.0.0.7:8000"}, bad: true},
		{name: "a path", values: []string{"10.0.0.7:8000/v1"}, bad: true},
		{name: "user info", values: []string{"user@10.0.0.7:8000"}, bad: true},
		{name: "a query", values: []string{"10.0.0.7:8000?x"}, bad: true},
		{name: "an address a resolver may read as octal", values: []string{"010.0.0.7:8000"}, bad: true},
		{name: "an address in hex", values: []string{"0x7f.1:8000"}, bad: true},
		{name: "a number as a host", values: []string{"2130706433:8000"}, bad: true},
		{name: "an underscore", values: []string{"vllm_prefill:8000"}, bad: true},
		{name: "an empty label", values: []string{"a..b:8000"}, bad: true},
		{name: "a label starting with a hyphen", values: []string{"-a.b:8000"}, bad: true},
		{name: "a label of 64", values: []string{strings.Repeat("a", 64) + ".svc:8000"}, bad: true},
		{name: "longer than any host:port", values: []string{strings.Repeat("a.", 300) + "svc:8000"}, bad: true},
		{name: "no host", values: []string{":8000"}, bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, named, err := parsePrefillerHeader(tc.values)
			if tc.bad {
				if err == nil {
					t.Fatalf("accepted %q as %+v", tc.values, p)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused %q: %v", tc.values, err)
			}
			if named != tc.named {
				t.Fatalf("named = %v, want %v", named, tc.named)
			}
			if named && p.hostPort() != tc.want {
				t.Errorf("hostPort = %q, want %q", p.hostPort(), tc.want)
			}
		})
	}
}

// FuzzPrefillerHeader feeds the header parser arbitrary values. It must never panic, and what
// it accepts is an address that reads back as itself: a host the dialler cannot take for
// another, and a port.
func FuzzPrefillerHeader(f *testing.F) {
	for _, s := range []string{"10.0.0.7:8000", "[fd00::7]:8000", "http://a.b:1", "a.b:1,c.d:2", "", "[::ffff:1.2.3.4]:5", "010.0.0.1:80", "x:0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		p, named, err := parsePrefillerHeader([]string{v})
		if err != nil || !named {
			return
		}
		if p.port == 0 {
			t.Fatalf("%q: port 0", v)
		}
		again, named, err := parsePrefillerHeader([]string{p.hostPort()})
		if err != nil || !named || again != p {
			t.Fatalf("%q parsed as %q, which reads back as %+v, %v", v, p.hostPort(), again, err)
		}
		if p.addr.IsValid() {
			if p.addr.Is4In6() || p.addr.Zone() != "" || p.host != p.addr.String() {
				t.Fatalf("%q: address %v not canonical", v, p.addr)
			}
			return
		}
		if _, err := netip.ParseAddr(p.host); err == nil {
			t.Fatalf("%q: host %q is an address taken for a name", v, p.host)
		}
		if p.host != strings.ToLower(p.host) || strings.ContainsAny(p.host, ":/[]%_ ") {
			t.Fatalf("%q: host %q is no DNS name", v, p.host)
		}
	})
}
