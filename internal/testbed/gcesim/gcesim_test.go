package gcesim

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"cloud.google.com/go/auth/credentials"
	"cloud.google.com/go/auth/httptransport"
	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
	"google.golang.org/api/option"
	"google.golang.org/protobuf/proto"
)

// The stand-in answers Google's own client as Compute Engine does:
// OAuth with the key, an insert's operation waited for, aggregated pages
// of a filtered list, and its error bodies.
func TestGoogleClientAgainstTheStandIn(t *testing.T) {
	s, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.AddImage("projects/runfleet-e2e/global/images/i", "")
	creds, err := credentials.NewCredentialsFromJSON(credentials.ServiceAccount, s.Credentials(), &credentials.DetectOptions{Scopes: []string{"https://www.googleapis.com/auth/compute"}})
	if err != nil {
		t.Fatal(err)
	}
	hc, err := httptransport.NewClient(&httptransport.Options{Credentials: creds})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	c, err := compute.NewInstancesRESTClient(ctx, option.WithHTTPClient(hc), option.WithEndpoint(s.URL))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		zone := Zones[i%2]
		op, err := c.Insert(ctx, &computepb.InsertInstanceRequest{Project: Project, Zone: zone, InstanceResource: &computepb.Instance{
			Name: proto.String(fmt.Sprintf("vm-%d", i)), MachineType: proto.String("zones/" + zone + "/machineTypes/e2-small"),
			Labels: map[string]string{"pool": []string{"a", "b"}[i%2]},
			Disks:  []*computepb.AttachedDisk{{Boot: proto.Bool(true), AutoDelete: proto.Bool(true), InitializeParams: &computepb.AttachedDiskInitializeParams{SourceImage: proto.String("projects/runfleet-e2e/global/images/i")}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := op.Wait(ctx); err != nil || op.Proto().GetError() != nil {
			t.Fatalf("insert vm-%d: %v %v", i, err, op.Proto().GetError())
		}
	}
	var names []string
	it := c.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{Project: Project, Filter: proto.String(`labels.pool = "a"`), MaxResults: proto.Uint32(1)})
	for {
		pair, err := it.Next()
		if errors.Is(err, iterator.Done) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range pair.Value.GetInstances() {
			names = append(names, in.GetName())
		}
	}
	if fmt.Sprint(names) != "[vm-0 vm-2 vm-4]" || s.Calls()["instances.aggregatedList"] != 3 {
		t.Errorf("pool a = %v in %d pages, want vm-0 vm-2 vm-4 in pages of one", names, s.Calls()["instances.aggregatedList"])
	}
	_, err = c.Get(ctx, &computepb.GetInstanceRequest{Project: Project, Zone: Zones[0], Instance: "nope"})
	var ge *googleapi.Error
	if !errors.As(err, &ge) || ge.Code != 404 || ge.Errors[0].Reason != "notFound" {
		t.Errorf("get of a missing instance: %v", err)
	}
	_, err = c.Insert(ctx, &computepb.InsertInstanceRequest{Project: Project, Zone: Zones[0], InstanceResource: &computepb.Instance{Name: proto.String("Bad Name")}})
	if !errors.As(err, &ge) || ge.Code != 400 || ge.Errors[0].Reason != "invalid" {
		t.Errorf("insert of a bad name: %v", err)
	}
	for _, f := range []string{`labels.pool = "a"`, `(labels.pool = a) (name != vm-0)`, `labels.pool = "a" AND name = "vm-2"`} {
		if _, err := parseFilter(f); err != nil {
			t.Errorf("filter %q: %v", f, err)
		}
	}
	if _, err := parseFilter(`labels.pool ~ a`); err == nil {
		t.Error("a filter the stand-in cannot read is taken")
	}
}
