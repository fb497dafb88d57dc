package deploy

import (
	"bytes"
	"debug/elf"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// No Docker engine runs where these tests run, so the image is checked in two halves: the
// Dockerfile for what it says (stages, user, entrypoint, build command), and the binary
// built with the very command its RUN line gives, for what a static, non-root image needs.

// dockerfile is a Dockerfile's stages, each with its instructions in order.
type dockerfile struct {
	stages []stage
}

// stage is one FROM and what follows it.
type stage struct {
	from, name string // the base image and the AS name ("" without one)
	instrs     []instr
}

// instr is one instruction: its keyword in upper case and the rest of its line, with
// continuation lines joined.
type instr struct {
	keyword, args string
}

// parseDockerfile reads the instructions of a Dockerfile: comments and blank lines skipped,
// lines ending in a backslash joined with the next. Instructions before the first FROM (ARG)
// belong to no stage.
func parseDockerfile(data []byte) (dockerfile, error) {
	var (
		df      dockerfile
		logical []string
		cur     strings.Builder
	)
	for _, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		if cur.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if rest, ok := strings.CutSuffix(trimmed, `\`); ok {
			cur.WriteString(rest + " ")
			continue
		}
		cur.WriteString(trimmed)
		logical = append(logical, cur.String())
		cur.Reset()
	}
	if cur.Len() > 0 {
		return df, fmt.Errorf("a continuation line ends the file: %q", cur.String())
	}
	for _, l := range logical {
		kw, args, _ := strings.Cut(l, " ")
		kw, args = strings.ToUpper(kw), strings.TrimSpace(args)
		if kw == "FROM" {
			f := strings.Fields(args)
			st := stage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				st.name = f[2]
			}
			df.stages = append(df.stages, st)
			continue
		}
		if len(df.stages) == 0 {
			if kw != "ARG" {
				return df, fmt.Errorf("%s before the first FROM", kw)
			}
			continue
		}
		last := &df.stages[len(df.stages)-1]
		last.instrs = append(last.instrs, instr{kw, args})
	}
	return df, nil
}

// find returns the stage's instructions with keyword kw.
func (s stage) find(kw string) []instr {
	var out []instr
	for _, in := range s.instrs {
		if in.keyword == kw {
			out = append(out, in)
		}
	}
	return out
}

// shellWords splits a shell command line into words as sh would for a simple command:
// single quotes keep everything, double quotes and backslashes their usual meaning. It
// knows no variables, globs or operators; the caller rejects what it cannot run.
func shellWords(s string) ([]string, error) {
	var (
		words []string
		cur   strings.Builder
		in    bool // inside a word
		quote rune
	)
	for i := 0; i < len(s); i++ {
		c := rune(s[i])
		switch {
		case quote == '\'':
			if c == '\'' {
				quote = 0
			} else {
				cur.WriteRune(c)
			}
		case quote == '"':
			switch {
			case c == '"':
				quote = 0
			case c == '\\' && i+1 < len(s) && strings.ContainsRune(`"\$`+"`", rune(s[i+1])):
				i++
				cur.WriteByte(s[i])
			default:
				cur.WriteRune(c)
			}
		case c == '\'' || c == '"':
			quote, in = c, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			in = true
		case c == ' ' || c == '\t':
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteRune(c)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote in %q", quote, s)
	}
	if in {
		words = append(words, cur.String())
	}
	return words, nil
}

// goBuild is the image's build command, as the Dockerfile's RUN line gives it.
type goBuild struct {
	env  []string // NAME=VALUE assignments before the command
	args []string // go's arguments, "build" first
	out  string   // the -o path
}

// imageRecipe is what the Dockerfile says about the image.
type imageRecipe struct {
	build      goBuild
	binary     string // where the final stage puts the binary
	user       string // the final stage's USER
	entrypoint []string
	stages     int
}

// readImageRecipe parses deploy/Dockerfile and fails the test where it does not say how to
// build the image as a multi-stage, static, non-root one.
func readImageRecipe(t *testing.T) imageRecipe {
	t.Helper()
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df, err := parseDockerfile(data)
	if err != nil {
		t.Fatalf("Dockerfile: %v", err)
	}
	r := imageRecipe{stages: len(df.stages)}
	if len(df.stages) < 2 {
		t.Fatalf("Dockerfile has %d stage(s): want a build stage and a runtime stage, so that the image carries no toolchain", len(df.stages))
	}
	final := df.stages[len(df.stages)-1]

	// The build stage: the one the final stage copies the binary from.
	copies := final.find("COPY")
	var buildStage *stage
	for _, c := range copies {
		f := strings.Fields(c.args)
		if len(f) != 3 || !strings.HasPrefix(f[0], "--from=") {
			continue
		}
		from := strings.TrimPrefix(f[0], "--from=")
		for i := range df.stages[:len(df.stages)-1] {
			if df.stages[i].name == from || strconv.Itoa(i) == from {
				buildStage = &df.stages[i]
				r.binary = f[2]
				r.build.out = f[1]
			}
		}
	}
	if buildStage == nil {
		t.Fatalf("the final stage copies nothing from a build stage (COPY --from=STAGE SRC DST): %v", copies)
	}
	if final.from == buildStage.from {
		t.Errorf("the final stage is based on %s, the build stage's image: the toolchain would ship in the image", final.from)
	}
	for _, run := range buildStage.find("RUN") {
		if !strings.Contains(run.args, "go build") {
			continue
		}
		words, err := shellWords(run.args)
		if err != nil {
			t.Fatalf("RUN %s: %v", run.args, err)
		}
		i := slices.Index(words, "go")
		if i < 0 {
			t.Fatalf("RUN %s: no go command", run.args)
		}
		for _, w := range words[:i] {
			if !strings.Contains(w, "=") {
				t.Fatalf("RUN %s: %q before go is not an environment assignment (this test runs the command itself)", run.args, w)
			}
		}
		for _, w := range words[i:] {
			if w == "&&" || w == ";" || w == "|" || strings.ContainsAny(w, "$`") {
				t.Fatalf("RUN %s: keep the go build a simple command (found %q), so this test can run it as it is", run.args, w)
			}
		}
		r.build.env, r.build.args = words[:i], words[i+1:]
	}
	if len(r.build.args) == 0 || r.build.args[0] != "build" {
		t.Fatal("the build stage has no RUN ... go build")
	}
	if j := slices.Index(r.build.args, "-o"); j < 0 || j+1 >= len(r.build.args) || r.build.args[j+1] != r.build.out {
		t.Errorf("go build %v does not write %s, which the final stage copies", r.build.args, r.build.out)
	}

	users := final.find("USER")
	if len(users) == 0 {
		t.Fatal("the final stage sets no USER: the image would run as root")
	}
	r.user = users[len(users)-1].args
	eps := final.find("ENTRYPOINT")
	if len(eps) == 0 {
		t.Fatal("the final stage has no ENTRYPOINT")
	}
	if err := json.Unmarshal([]byte(eps[len(eps)-1].args), &r.entrypoint); err != nil {
		t.Fatalf("ENTRYPOINT %s is not in exec form (a JSON array): with no shell in the image, the shell form cannot run, and the binary would not get SIGTERM: %v",
			eps[len(eps)-1].args, err)
	}
	return r
}

// imageUID is the numeric user the Dockerfile's USER names; it fails the test for a name or
// for root, which Kubernetes' runAsNonRoot cannot verify or refuses.
func imageUID(t *testing.T, user string) int64 {
	t.Helper()
	u, g, hasGroup := strings.Cut(user, ":")
	uid, err := strconv.ParseInt(u, 10, 64)
	if err != nil {
		t.Fatalf("USER %s: not numeric; Kubernetes' runAsNonRoot cannot verify a user name", user)
	}
	if uid == 0 {
		t.Fatalf("USER %s is root", user)
	}
	if hasGroup {
		if gid, err := strconv.ParseInt(g, 10, 64); err != nil || gid == 0 {
			t.Fatalf("USER %s: the group is not a numeric non-root group", user)
		}
	}
	return uid
}

func TestDockerfileBuildsAStaticBinaryIntoANonRootImage(t *testing.T) {
	r := readImageRecipe(t)
	checks := []struct {
		name string
		ok   bool
		why  string
	}{
		{"multi-stage", r.stages >= 2, "a build stage and a runtime stage"},
		{"cgo off", slices.Contains(r.build.env, "CGO_ENABLED=0"), fmt.Sprintf("go build runs with %v, want CGO_ENABLED=0: the runtime image has no libc", r.build.env)},
		{"trimpath", slices.Contains(r.build.args, "-trimpath"), fmt.Sprintf("go build %v, want -trimpath", r.build.args)},
		{"stripped", slices.Contains(r.build.args, "-ldflags=-s -w"), fmt.Sprintf("go build %v, want -ldflags='-s -w'", r.build.args)},
		{"builds cmd/proxy", slices.Contains(r.build.args, "./cmd/proxy"), fmt.Sprintf("go build %v, want ./cmd/proxy", r.build.args)},
		{"entrypoint is the binary", len(r.entrypoint) > 0 && r.entrypoint[0] == r.binary, fmt.Sprintf("ENTRYPOINT %v, want [%q ...], where the final stage copies the binary", r.entrypoint, r.binary)},
	}
	for _, c := range checks {
		t.Run(c.name, func(t *testing.T) {
			if !c.ok {
				t.Error(c.why)
			}
		})
	}
	t.Run("non-root user", func(t *testing.T) { imageUID(t, r.user) })
}

// TestBinaryBuiltAsTheDockerfileSaysIsStatic runs the Dockerfile's own go build (its
// environment and arguments, with the output redirected to a temporary file) and checks
// what the distroless image needs: no dynamic loader and no shared library, so the binary
// runs on an image without libc; stripped; no build paths; and it runs.
func TestBinaryBuiltAsTheDockerfileSaysIsStatic(t *testing.T) {
	r := readImageRecipe(t)
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is not on PATH (go test puts its own there): %v", err)
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "pdproxy")
	args := slices.Clone(r.build.args)
	args[slices.Index(args, "-o")+1] = bin
	cmd := exec.Command(gobin, args...)
	cmd.Dir = root // the build context is the repository root
	cmd.Env = append(os.Environ(), r.build.env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", r.build.env, args, err, out)
	}

	f, err := elf.Open(bin)
	if err != nil {
		t.Fatalf("not an ELF binary: %v", err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary has a PT_INTERP program header: it needs a dynamic loader the image does not have")
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("the binary needs shared libraries (DT_NEEDED) %v (err %v): the image has none", libs, err)
	}
	if f.Section(".symtab") != nil {
		t.Error("the binary has a symbol table: -ldflags='-s -w' should have stripped it")
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte(root+string(filepath.Separator))) {
		t.Errorf("the binary contains the build directory %s: -trimpath should have removed it", root)
	}

	// It is a working pdproxy: --help prints the usage and exits 0, as `docker run IMAGE
	// --help` would.
	var out bytes.Buffer
	help := exec.Command(bin, "--help")
	help.Stdout, help.Stderr = &out, &out
	if err := help.Run(); err != nil {
		t.Fatalf("%s --help: %v\n%s", bin, err, out.String())
	}
	if !strings.Contains(out.String(), "Usage: proxy") {
		t.Errorf("%s --help printed no usage:\n%s", bin, out.String())
	}
}

func TestShellWordsSplitsAsShDoes(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{`CGO_ENABLED=0 go build -ldflags='-s -w' ./cmd/proxy`, []string{"CGO_ENABLED=0", "go", "build", "-ldflags=-s -w", "./cmd/proxy"}},
		{`go build -ldflags "-s -w" -o /out/x`, []string{"go", "build", "-ldflags", "-s -w", "-o", "/out/x"}},
		{`a\ b  "c\"d" ''`, []string{"a b", `c"d`, ""}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := shellWords(tt.in)
			if err != nil || !slices.Equal(got, tt.want) {
				t.Errorf("shellWords(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
		})
	}
	if _, err := shellWords(`go build -ldflags='-s`); err == nil {
		t.Error("an unterminated quote was accepted")
	}
}
