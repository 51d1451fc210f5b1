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
