package clitest

import (
	"reflect"
	"testing"
)

func TestSynopsis(t *testing.T) {
	doc := []byte("The tool:\n\n```\n" +
		"tool run --config FILE [--fast]   # runs it, --not-a-flag of run\n" +
		"         [--slow]\n" +
		"other-tool run --x\n" +
		"    [--indented-after-another-program]\n" +
		"tool stop\n" +
		"\n" +
		"  [--after-a-blank-line]\n" +
		"```\n\n" +
		"tool run --outside-a-fence\n\n" +
		"```\ntool-lab run --lab\ntool run2 --y\t# a tab comment --z\n```\n" +
		"```sh\ntool run --an-example-not-the-synopsis\n```\n")
	got := Synopsis(doc, "tool")
	want := map[string]string{
		"run":  " tool run --config FILE [--fast]  " + " " + "         [--slow]", // each line after " " up to its comment
		"stop": " tool stop",
		"run2": " tool run2 --y",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Synopsis = %q\nwant %q", got, want)
	}
}

func TestShownDefault(t *testing.T) {
	for _, c := range []struct {
		value, want string
		ok          bool
	}{
		{"1", "1", true},
		{"paper|tight", "paper", true},
		{"127.0.0.1:9092", "127.0.0.1:9092", true},
		{"N", "", false}, // a placeholder
		{"FILE.csv|NAME", "", false},
		{"|", "", false}, // "[--settle | --settle-means]"
		{"--partitions", "", false},
		{"", "", false},
	} {
		if got, ok := shownDefault(c.value); got != c.want || ok != c.ok {
			t.Errorf("shownDefault(%q) = %q, %v; want %q, %v", c.value, got, ok, c.want, c.ok)
		}
	}
}

func TestSameDefault(t *testing.T) {
	for _, c := range []struct {
		shown, def string
		want       bool
	}{
		{"60s", "1m0s", true},
		{"168h", "168h0m0s", true},
		{"2m", "1m0s", false},
		{"1e-5", "1e-05", true},
		{"0.2", "0.2", true},
		{"1024", "1000", false},
		{"relu", "relu", true},
		{"k1", "k2", false},
	} {
		if got := sameDefault(c.shown, c.def); got != c.want {
			t.Errorf("sameDefault(%q, %q) = %v, want %v", c.shown, c.def, got, c.want)
		}
	}
}

func TestNamedFlags(t *testing.T) {
	for _, c := range []struct {
		text string
		want [][2]string // name, value
	}{
		{"--mode paper|tight [--fast]", [][2]string{{"mode", "paper|tight"}, {"fast", ""}}},
		{"--scaler-from CSV|--no-scaler --out DIR", [][2]string{{"scaler-from", "CSV|"}, {"no-scaler", ""}, {"out", "DIR"}}},
		{"(--scaler-from CSV | --no-scaler)", [][2]string{{"scaler-from", "CSV"}, {"no-scaler", ""}}},
		{"--verbose --out DIR", [][2]string{{"verbose", ""}, {"out", "DIR"}}}, // a flag is no value
	} {
		var got [][2]string
		for _, m := range namedFlags(c.text) {
			got = append(got, [2]string{m[1], m[2]})
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("namedFlags(%q) = %q, want %q", c.text, got, c.want)
		}
	}
}
