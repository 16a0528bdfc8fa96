package gpu

import (
	"fmt"
	"slices"
	"strings"
	"text/template"
)

// Image is a runner image and the oldest CUDA version it needs from the
// driver.
type Image struct {
	Image   string  `json:"image"`
	MinCUDA Version `json:"min_cuda"`
}

// TemplateData is what an image template can use: {{.CUDA}} is "12.4".
type TemplateData struct {
	CUDA      string
	CUDAMajor int
	CUDAMinor int
	Driver    string
}

// IsTemplate reports whether an image reference is a template.
func IsTemplate(image string) bool { return strings.Contains(image, "{{") }

// CheckTemplate parses an image template, for config validation.
func CheckTemplate(image string) error {
	_, err := template.New("image").Option("missingkey=error").Parse(image)
	return err
}

// PickImage chooses the runner image for a host: an image template is
// filled in with the host's CUDA version; from a list, the image with the
// newest minimum the driver supports wins. When no image fits, the error
// says what the driver supports and what each image needs.
func PickImage(image string, images []Image, inv Inventory) (string, error) {
	if len(images) == 0 {
		if !IsTemplate(image) {
			return image, nil
		}
		tmpl, err := template.New("image").Option("missingkey=error").Parse(image)
		if err != nil {
			return "", fmt.Errorf("image template %q: %w", image, err)
		}
		if inv.CUDA.IsZero() && strings.Contains(image, "CUDA") {
			return "", fmt.Errorf("image template %q needs the driver's CUDA version, and this host has none (%s)", image, why(inv))
		}
		var b strings.Builder
		err = tmpl.Execute(&b, TemplateData{CUDA: inv.CUDA.String(), CUDAMajor: inv.CUDA.Major, CUDAMinor: inv.CUDA.Minor, Driver: inv.Driver})
		if err != nil {
			return "", fmt.Errorf("image template %q: %w", image, err)
		}
		return b.String(), nil
	}
	fit := -1
	for i, im := range images {
		if im.MinCUDA.Compare(inv.CUDA) <= 0 && (fit < 0 || im.MinCUDA.Compare(images[fit].MinCUDA) > 0) {
			fit = i
		}
	}
	if fit >= 0 && (!inv.CUDA.IsZero() || images[fit].MinCUDA.IsZero()) {
		return images[fit].Image, nil
	}
	var needs []string
	for _, im := range slices.SortedFunc(slices.Values(images), func(a, b Image) int { return a.MinCUDA.Compare(b.MinCUDA) }) {
		needs = append(needs, fmt.Sprintf("%s needs CUDA %s", im.Image, im.MinCUDA))
	}
	have := "this host has no CUDA driver (" + why(inv) + ")"
	if !inv.CUDA.IsZero() {
		have = fmt.Sprintf("the driver (%s) supports CUDA up to %s", inv.Driver, inv.CUDA)
	}
	return "", fmt.Errorf("no image fits: %s; %s", have, strings.Join(needs, ", "))
}

func why(inv Inventory) string {
	if inv.Reason != "" {
		return inv.Reason
	}
	return "no CUDA version reported"
}
