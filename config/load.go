package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// ErrInvalid is wrapped by every error from Load and Validate.
var ErrInvalid = errors.New("invalid configuration")

// Load parses YAML text over the defaults, rejecting unknown keys, then validates. Every error
// names its key path (certify.on_breach) and line.
func Load(text string) (*Config, error) {
	c := Default()
	var doc yaml.Node
	dec := yaml.NewDecoder(strings.NewReader(text))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	// yaml.Unmarshal would read the first document alone and drop the rest, keys and mistakes.
	for {
		var more yaml.Node
		err := dec.Decode(&more)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if !noKeys(&more) {
			return nil, fmt.Errorf("%w: line %d: another YAML document (after ---): the configuration is one document; merge its keys into the first", ErrInvalid, more.Line)
		}
	}
	c.empty = noKeys(&doc)
	if !c.empty {
		root := doc.Content[0]
		if root.Kind != yaml.MappingNode {
			return nil, fmt.Errorf("%w: line %d: the configuration must be a mapping of keys (http:, kafka:, ...), got %s", ErrInvalid, root.Line, nodeKind(root))
		}
		if errs := decodeStrict(root, reflect.ValueOf(&c).Elem(), ""); len(errs) > 0 {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
		}
	}
	var lines map[string]int
	if !c.empty {
		lines = keyLines(doc.Content[0], "", map[string]int{})
	}
	if err := c.validate(lines); err != nil {
		return nil, err
	}
	return &c, nil
}

// keyLines records in lines the line of each key under n, by its path (section.key, and
// section.key[i] for the items of a list), and returns lines.
func keyLines(n *yaml.Node, path string, lines map[string]int) map[string]int {
	n = resolved(n)
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			if path != "" {
				key = path + "." + key
			}
			lines[key] = n.Content[i].Line
			keyLines(n.Content[i+1], key, lines)
		}
	case yaml.SequenceNode:
		for i, item := range n.Content {
			lines[fmt.Sprintf("%s[%d]", path, i)] = item.Line
		}
	}
	return lines
}

// keyAt is key as an error names it: with the line the text gave it on, when lines knows it.
func keyAt(lines map[string]int, key string) string {
	if line := lines[key]; line > 0 {
		return fmt.Sprintf("%s (line %d)", key, line)
	}
	return key
}

// decodeStrict decodes node n into v (a struct field or the Config), walking mappings beside
// the struct so that each error carries its key path: unknown and repeated keys are errors, and a
// value that does not decode (a bad number, an unknown enum name) is reported under its key.
// Keys absent from the text keep their defaults.
func decodeStrict(n *yaml.Node, v reflect.Value, path string) []error {
	n = resolved(n)
	if v.Kind() != reflect.Struct {
		if err := checkScalar(n, v, path); err != nil {
			return []error{err}
		}
		if err := n.Decode(v.Addr().Interface()); err != nil {
			return []error{fmt.Errorf("%s (line %d): %s%s", path, n.Line, yamlMessage(err), valueHint(v))}
		}
		return nil
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil // "kafka:" with nothing under it: every default stays
	}
	if n.Kind != yaml.MappingNode {
		return []error{fmt.Errorf("%s (line %d): want a mapping of keys, got %s", path, n.Line, nodeKind(n))}
	}
	var errs []error
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		key := k.Value
		if path != "" {
			key = path + "." + k.Value
		}
		if line, dup := seen[k.Value]; dup {
			errs = append(errs, fmt.Errorf("%s (line %d): given twice (first on line %d)", key, k.Line, line))
			continue
		}
		seen[k.Value] = k.Line
		f, names := fieldByKey(v, k.Value)
		if !f.IsValid() {
			hint := suggest(k.Value, names)
			if now, ok := renamedKey(key); ok {
				hint = fmt.Sprintf(" (renamed %s)", now)
			}
			errs = append(errs, fmt.Errorf("%s (line %d): unknown key%s", key, k.Line, hint))
			continue
		}
		errs = append(errs, decodeStrict(n.Content[i+1], f, key)...)
	}
	return errs
}

// checkScalar refuses what yaml would decode into v without a word: a key with no value (yaml
// leaves the default in place) and a fraction for an integer key (yaml truncates 10.5 to 10).
func checkScalar(n *yaml.Node, v reflect.Value, path string) error {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return fmt.Errorf("%s (line %d): the key has no value; give one, or remove the key to keep the default (%s)", path, n.Line, defaultText(v))
	}
	if _, ok := v.Interface().(time.Duration); ok {
		return nil // a duration is text (5s); its decode names what a number is not
	}
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!float" {
			return nil
		}
		var f float64
		if err := n.Decode(&f); err != nil {
			return nil // the decode that follows names the key
		}
		if f != math.Trunc(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%s (line %d): %s is not a whole number", path, n.Line, n.Value)
		}
		// yaml turns a float beyond the integer's range into its nearest bound, silently.
		if v.CanInt() && (f < math.MinInt64 || f >= math.MaxInt64) || v.CanUint() && (f < 0 || f >= math.MaxUint64) {
			return fmt.Errorf("%s (line %d): %s is out of range", path, n.Line, n.Value)
		}
	}
	return nil
}

// valueHint says what a key of v's type takes, for a value that does not decode into it: yaml's
// own message names the Go type only.
func valueHint(v reflect.Value) string {
	switch v.Interface().(type) {
	case time.Duration:
		return " (want a duration with its unit, such as 500ms, 5s, 2m or 1h)"
	case slog.Level:
		return " (want debug, info, warn or error)"
	}
	return ""
}

// defaultText renders the value a key keeps when it is absent, as the key would be written.
func defaultText(v reflect.Value) string {
	switch x := v.Interface().(type) {
	case time.Duration:
		return x.String()
	case string:
		return strconv.Quote(x)
	case []string:
		return fmt.Sprintf("%q", x)
	case fmt.Stringer:
		return x.String()
	}
	return fmt.Sprint(v.Interface())
}

// renamedKey gives the name now of a key an earlier release used.
func renamedKey(key string) (string, bool) {
	switch key {
	case "update.steps":
		return "update.iterations", true
	case "http.max_concurrent_predict":
		return "http.max_predict_inputs, which counts inputs, not requests", true
	}
	return "", false
}

// fieldByKey returns the field of struct v whose yaml tag is key (invalid if none), and every
// key v accepts.
func fieldByKey(v reflect.Value, key string) (reflect.Value, []string) {
	var names []string
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ",")
		if name == "" || name == "-" {
			continue
		}
		if name == key {
			return v.Field(i), nil
		}
		names = append(names, name)
	}
	return reflect.Value{}, names
}

// suggest names the accepted key closest to a misspelt one (edit distance <= 2).
func suggest(key string, names []string) string {
	best, bestD := "", 3
	for _, n := range names {
		if d := editDistance(key, n); d < bestD {
			best, bestD = n, d
		}
	}
	if best == "" {
		return fmt.Sprintf(" (accepted here: %s)", strings.Join(names, ", "))
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// yamlMessage strips yaml's "yaml: unmarshal errors: line N:" wrapping (decodeStrict gives the
// line itself).
func yamlMessage(err error) string {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs := make([]string, len(te.Errors))
		for i, e := range te.Errors {
			if _, rest, ok := strings.Cut(e, ": "); ok && strings.HasPrefix(e, "line ") {
				e = rest
			}
			msgs[i] = e
		}
		return strings.Join(msgs, "; ")
	}
	return err.Error()
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.MappingNode:
		return "a mapping"
	}
	return fmt.Sprintf("the value %q", n.Value)
}

// noKeys reports whether a parsed YAML document has no keys ("", comments only, "{}", "~").
func noKeys(n *yaml.Node) bool {
	if n.Kind == 0 {
		return true
	}
	if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		c := n.Content[0]
		return c.Kind == yaml.MappingNode && len(c.Content) == 0 || c.Kind == yaml.ScalarNode && c.Tag == "!!null"
	}
	return false
}

// LoadFile reads and parses a configuration file, then applies environment overrides: for
// secrets (CFGUARD_HTTP_TOKEN, CFGUARD_HTTP_METRICS_TOKEN, CFGUARD_KAFKA_SASL_PASSWORD,
// CFGUARD_REPLICATION_KEY_FILE) and for replication.advertise_url
// (CFGUARD_REPLICATION_ADVERTISE_URL), and checks the files it names (CheckFiles).
func LoadFile(path string) (*Config, error) {
	c, err := LoadClientFile(path)
	if err != nil {
		return nil, err
	}
	if err := c.CheckFiles(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// LoadClientFile is LoadFile without CheckFiles, for the commands that only talk to a running
// daemon's API (cfguard backup, cfguard import-ces), which read http.listen and http.token, and
// for cfguard restore, which reads state_dir: they run where the files the configuration names
// (model.path, replication.key_file, TLS files) need not exist, such as an operator's machine
// with the daemon's configuration file, or a pod that mounts the state volume alone.
func LoadClientFile(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if bytes.Contains(b, []byte("\t")) {
		// yaml.v3's own message for tabs is obscure; say it plainly.
		for i, line := range bytes.Split(b, []byte("\n")) {
			if bytes.HasPrefix(bytes.TrimLeft(line, " "), []byte("\t")) {
				return nil, fmt.Errorf("%w: %s:%d: indentation uses a tab; YAML needs spaces", ErrInvalid, path, i+1)
			}
		}
	}
	c, err := Load(string(b))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, tk := range []struct {
		env string
		dst *string
	}{{"CFGUARD_HTTP_TOKEN", &c.HTTP.Token}, {"CFGUARD_HTTP_METRICS_TOKEN", &c.HTTP.MetricsToken}} {
		if v := os.Getenv(tk.env); v != "" {
			if why := tokenProblem(v); why != "" {
				return nil, fmt.Errorf("%w: %s: %s", ErrInvalid, tk.env, why)
			}
			*tk.dst = v
		}
	}
	if v := os.Getenv("CFGUARD_KAFKA_SASL_PASSWORD"); v != "" {
		if c.Kafka.SASL.Mechanism == "" {
			return nil, fmt.Errorf("%w: CFGUARD_KAFKA_SASL_PASSWORD: %s: %sset kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512) "+
				"and kafka.sasl.username in %s, or unset the variable", ErrInvalid, redacted, saslWithoutMechanism, path)
		}
		c.Kafka.SASL.Password = v
	}
	if v := os.Getenv("CFGUARD_REPLICATION_KEY_FILE"); v != "" {
		c.Replication.KeyFile = v
	}
	if v := os.Getenv("CFGUARD_REPLICATION_ADVERTISE_URL"); v != "" {
		// A replica's own address is known only where it runs (Kubernetes: the pod's IP, from
		// the downward API), so it comes from the environment; it is checked as the key is.
		c.Replication.AdvertiseURL = v
		if err := c.Validate(); err != nil {
			return nil, fmt.Errorf("%s, with CFGUARD_REPLICATION_ADVERTISE_URL=%q: %w", path, v, err)
		}
	}
	return c, nil
}
