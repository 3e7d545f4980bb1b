package model

import (
	"strings"
	"testing"
)

func TestLayerTensorName(t *testing.T) {
	if got := LayerTensorName(3, QProj); got != "model.layers.3.self_attn.q_proj.weight" {
		t.Fatal(got)
	}
	if got := LayerTensorName(12, DownProj); got != "model.layers.12.mlp.down_proj.weight" {
		t.Fatal(got)
	}
}

func TestParseLayers(t *testing.T) {
	good := []struct {
		s           string
		n           int
		first, last int
	}{
		{"0-11", 12, 0, 11}, {"5", 6, 5, 5}, {" 3-4 ", 6, 3, 4}, {"0-0", 1, 0, 0}, {"2 - 5", 6, 2, 5},
	}
	for _, g := range good {
		f, l, err := ParseLayers(g.s, g.n)
		if err != nil || f != g.first || l != g.last {
			t.Errorf("ParseLayers(%q, %d) = %d, %d, %v", g.s, g.n, f, l, err)
		}
	}
	bad := []struct {
		s    string
		n    int
		want string
	}{
		{"7-3", 32, "reversed"},
		{"0-40", 32, "beyond the model: it has 32 layers (0-31)"},
		{"32", 32, "beyond the model"},
		{"6", 6, "beyond the model"},
		{"", 6, "empty layer range"},
		{"a-b", 6, "not a layer number"},
		{"-1", 6, "missing layer number"},
		{"1-", 6, "missing layer number"},
		{"1-2-3", 6, "not a layer number"},
		{"+1", 6, "not a layer number"},
		{"99999999999999999999", 6, "too large"},
	}
	for _, b := range bad {
		_, _, err := ParseLayers(b.s, b.n)
		if err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("ParseLayers(%q, %d): error %v, want %q", b.s, b.n, err, b.want)
		}
	}
}
