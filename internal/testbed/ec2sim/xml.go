package ec2sim

import (
	"encoding/xml"
	"maps"
	"slices"
	"time"
)

// The Query API's answers, as the EC2 API reference shows them.

type runResponse struct {
	XMLName     xml.Name      `xml:"RunInstancesResponse"`
	RequestID   string        `xml:"requestId"`
	Reservation string        `xml:"reservationId"`
	Owner       string        `xml:"ownerId"`
	Instances   []instanceXML `xml:"instancesSet>item"`
}

type describeResponse struct {
	XMLName      xml.Name         `xml:"DescribeInstancesResponse"`
	RequestID    string           `xml:"requestId"`
	Reservations []reservationXML `xml:"reservationSet>item"`
	NextToken    string           `xml:"nextToken,omitempty"`
}

type reservationXML struct {
	ID        string        `xml:"reservationId"`
	Owner     string        `xml:"ownerId"`
	Instances []instanceXML `xml:"instancesSet>item"`
}

type instanceXML struct {
	ID          string     `xml:"instanceId"`
	ImageID     string     `xml:"imageId"`
	State       stateXML   `xml:"instanceState"`
	Type        string     `xml:"instanceType"`
	LaunchTime  string     `xml:"launchTime"`
	Zone        string     `xml:"placement>availabilityZone"`
	SubnetID    string     `xml:"subnetId"`
	Lifecycle   string     `xml:"instanceLifecycle,omitempty"`
	SpotRequest string     `xml:"spotInstanceRequestId,omitempty"`
	Reason      *reasonXML `xml:"stateReason,omitempty"`
	Tags        []tagXML   `xml:"tagSet>item"`
}

type stateXML struct {
	Code int    `xml:"code"`
	Name string `xml:"name"`
}

type reasonXML struct {
	Code    string `xml:"code"`
	Message string `xml:"message"`
}

type tagXML struct {
	Key   string `xml:"key"`
	Value string `xml:"value"`
}

type terminateResponse struct {
	XMLName   xml.Name         `xml:"TerminateInstancesResponse"`
	RequestID string           `xml:"requestId"`
	Instances []stateChangeXML `xml:"instancesSet>item"`
}

type stateChangeXML struct {
	ID       string   `xml:"instanceId"`
	Current  stateXML `xml:"currentState"`
	Previous stateXML `xml:"previousState"`
}

type simpleResponse struct {
	XMLName   xml.Name
	RequestID string `xml:"requestId"`
	Return    bool   `xml:"return"`
}

type spotResponse struct {
	XMLName   xml.Name  `xml:"DescribeSpotInstanceRequestsResponse"`
	RequestID string    `xml:"requestId"`
	Requests  []spotXML `xml:"spotInstanceRequestSet>item"`
}

type spotXML struct {
	ID         string        `xml:"spotInstanceRequestId"`
	SpotPrice  string        `xml:"spotPrice,omitempty"`
	Type       string        `xml:"type"`
	State      string        `xml:"state"`
	Status     spotStatusXML `xml:"status"`
	InstanceID string        `xml:"instanceId"`
}

type spotStatusXML struct {
	Code       string `xml:"code"`
	UpdateTime string `xml:"updateTime"`
	Message    string `xml:"message"`
}

// xml is the instance as DescribeInstances shows it. Called with s.mu
// held.
func (in *Instance) xml() instanceXML {
	x := instanceXML{
		ID: in.ID, ImageID: in.Image, State: stateXML{stateCodes[in.State], in.State}, Type: in.Type,
		LaunchTime: in.Launched.Format(time.RFC3339), Zone: in.Zone, SubnetID: in.Subnet,
	}
	if in.Spot {
		x.Lifecycle, x.SpotRequest = "spot", in.SpotRequest
	}
	if in.ReasonCode != "" {
		x.Reason = &reasonXML{in.ReasonCode, in.ReasonMessage}
	}
	for _, k := range slices.Sorted(maps.Keys(in.Tags)) {
		x.Tags = append(x.Tags, tagXML{k, in.Tags[k]})
	}
	return x
}
