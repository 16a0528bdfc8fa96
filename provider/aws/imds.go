package aws

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/runfleet/runfleet/bootstrap"
)

// Metadata is the instance side's view of EC2's instance metadata service
// (IMDSv2 only: a session token on every read). It tells a runner's
// machine that its spot capacity is being taken back
// (spot/instance-action) or that a rebalance is recommended
// (events/recommendations/rebalance). Both paths answer 404 until there
// is a notice.
type Metadata struct{ c *imds.Client }

var _ bootstrap.Notices = Metadata{}

func init() { bootstrap.RegisterNotices("aws", func() bootstrap.Notices { return NewMetadata() }) }

// NewMetadata is the metadata service at its link-local address, or at
// AWS_EC2_METADATA_SERVICE_ENDPOINT when that is set.
func NewMetadata() Metadata {
	return Metadata{imds.New(imds.Options{EnableFallback: awssdk.FalseTernary})}
}

// instanceAction is spot/instance-action's document.
type instanceAction struct {
	Action string    `json:"action"` // terminate, stop, hibernate
	Time   time.Time `json:"time"`
}

func (m Metadata) Interruption(ctx context.Context) (time.Time, bool, error) {
	b, ok, err := m.get(ctx, "spot/instance-action")
	if err != nil || !ok {
		return time.Time{}, false, err
	}
	var a instanceAction
	if err := json.Unmarshal(b, &a); err != nil {
		return time.Time{}, false, fmt.Errorf("spot/instance-action: %w", err)
	}
	return a.Time, true, nil
}

func (m Metadata) Rebalance(ctx context.Context) (bool, error) {
	_, ok, err := m.get(ctx, "events/recommendations/rebalance")
	return ok, err
}

// get reads a metadata path; a 404 is no document, not an error.
func (m Metadata) get(ctx context.Context, path string) ([]byte, bool, error) {
	out, err := m.c.GetMetadata(ctx, &imds.GetMetadataInput{Path: path})
	var re *smithyhttp.ResponseError
	if errors.As(err, &re) && re.HTTPStatusCode() == http.StatusNotFound {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("metadata %s: %w", path, err)
	}
	defer out.Content.Close()
	b, err := io.ReadAll(io.LimitReader(out.Content, 64<<10))
	if err != nil {
		return nil, false, fmt.Errorf("metadata %s: %w", path, err)
	}
	return b, true, nil
}
