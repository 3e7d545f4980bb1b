package bench

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"strings"
)

// CheckSVG parses the file at path as XML and checks that it is an SVG whose
// text names every series (the legend). Tests of the suites and of the CLI
// use it to check a chart without a browser.
func CheckSVG(path string, series ...string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dec := xml.NewDecoder(bytes.NewReader(data))
	var root string
	var text strings.Builder
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("%s is not valid XML: %w", path, err)
		}
		switch v := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = v.Name.Local
			}
		case xml.CharData:
			text.Write(v)
		}
	}
	if root != "svg" {
		return fmt.Errorf("%s: root element %q, want svg", path, root)
	}
	var missing []string
	for _, s := range series {
		if !strings.Contains(text.String(), s) {
			missing = append(missing, s)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s: series %s not named in the chart", path, strings.Join(missing, ", "))
	}
	return nil
}
