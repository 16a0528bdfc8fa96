package ec2sim

import (
	"encoding/base64"
	"encoding/xml"
	"fmt"
	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"maps"
	"math"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Instance is one stand-in instance.
type Instance struct {
	ID, Type, Image, Subnet, Zone, Reservation string
	State                                      string // pending, running, shutting-down, terminated
	Launched                                   time.Time
	Tags                                       map[string]string
	SpotTags                                   map[string]string // the spot request's
	Spot                                       bool
	SpotRequest, MaxPrice                      string
	SpotStatus                                 string
	SpotStatusTime                             time.Time
	UserData                                   []byte
	Shutdown                                   string // stop or terminate
	HTTPTokens                                 string // required: IMDSv2 only
	Profile                                    string
	ReasonCode, ReasonMessage                  string

	action    *noticeDoc // spot/instance-action
	rebalance *time.Time
	machine   *vmboot.Machine
	hostname  string
	finishing bool
	// Console is what the instance printed (its container's log), kept
	// when it ends.
	Console string
	// Ended is when it was terminated.
	Ended time.Time
	// Created and Stopping are when RunInstances made it and when it
	// began shutting down, to the nanosecond (Launched, as EC2 gives it,
	// is to the second): its span in the pool's count.
	Created, Stopping time.Time
}

// shutDown marks it shutting down, from the first cause on.
func (in *Instance) shutDown() {
	in.State = "shutting-down"
	if in.Stopping.IsZero() {
		in.Stopping = time.Now()
	}
}

// stateCodes are EC2's instance state codes.
var stateCodes = map[string]int{"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48, "stopping": 64, "stopped": 80}

// knownTypes are the instance types the stand-in offers.
var knownTypes = regexp.MustCompile(`^(t2|t3|t3a|m5|m6i|c5|r5|g4dn|g5|g6|p2|p3|p4d|p5)\.(nano|micro|small|medium|large|xlarge|\d+xlarge|metal)$`)

func (s *Server) runInstances(form url.Values) (any, *apiError) {
	minCount, _ := strconv.Atoi(form.Get("MinCount"))
	maxCount, _ := strconv.Atoi(form.Get("MaxCount"))
	switch {
	case form.Get("MinCount") == "" || form.Get("MaxCount") == "":
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter MinCount and MaxCount"}
	case minCount < 1 || maxCount < minCount:
		return nil, badParam("Invalid value for MinCount/MaxCount")
	}
	lt := form.Get("LaunchTemplate.LaunchTemplateId") + form.Get("LaunchTemplate.LaunchTemplateName")
	if lt != "" {
		return nil, &apiError{http.StatusBadRequest, "InvalidLaunchTemplateId.NotFound", fmt.Sprintf("The specified launch template, with template ID %s, does not exist.", lt)}
	}
	ami := form.Get("ImageId")
	if ami == "" {
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter ImageId"}
	}
	// RunInstances takes resolve:ssm:<parameter> for an AMI and resolves
	// it at launch; the instance then names the AMI itself (EC2 User
	// Guide, "Reference AMIs using Systems Manager parameters"). How EC2
	// words a parameter that does not exist is not documented: the
	// stand-in refuses it as an invalid value.
	if name, ok := strings.CutPrefix(ami, "resolve:ssm:"); ok {
		s.mu.Lock()
		resolved, known := s.params[name]
		s.mu.Unlock()
		if !known {
			return nil, badParam("Invalid value '%s' for ImageId: parameter %s not found.", ami, name)
		}
		ami = resolved
	}
	if !regexp.MustCompile(`^ami-[0-9a-f]{8,17}$`).MatchString(ami) {
		return nil, &apiError{http.StatusBadRequest, "InvalidAMIID.Malformed", fmt.Sprintf("Invalid id: \"%s\" (expecting \"ami-...\")", ami)}
	}
	typ := form.Get("InstanceType")
	if typ == "" {
		typ = "m1.small" // EC2's default, which the stand-in does not offer
	}
	if !knownTypes.MatchString(typ) {
		return nil, badParam("Invalid value '%s' for InstanceType.", typ)
	}
	shutdown := form.Get("InstanceInitiatedShutdownBehavior")
	spot := form.Get("InstanceMarketOptions.MarketType") == "spot"
	if shutdown == "" {
		shutdown = "stop"
	}
	if spot && shutdown != "terminate" && form.Get("InstanceMarketOptions.SpotOptions.SpotInstanceType") != "persistent" {
		return nil, &apiError{http.StatusBadRequest, "UnsupportedOperation", "The instance's shutdown behavior must be terminate for a one-time spot instance."}
	}
	ud, err := base64.StdEncoding.DecodeString(form.Get("UserData"))
	if err != nil {
		return nil, &apiError{http.StatusBadRequest, "InvalidUserData.Malformed", "User data is not valid base64."}
	}
	if len(ud) > 16<<10 {
		return nil, badParam("User data is limited to 16384 bytes")
	}
	for _, sg := range list(form, "SecurityGroupId") {
		if !strings.HasPrefix(sg, "sg-") {
			return nil, &apiError{http.StatusBadRequest, "InvalidGroupId.Malformed", fmt.Sprintf("Invalid id: \"%s\"", sg)}
		}
	}
	instTags, aerr := tagSpecs(form, "instance")
	if aerr != nil {
		return nil, aerr
	}
	spotTags, _ := tagSpecs(form, "spot-instances-request")
	volTags, _ := tagSpecs(form, "volume")

	s.mu.Lock()
	defer s.mu.Unlock()
	if tok := form.Get("ClientToken"); tok != "" {
		if id, ok := s.tokens[tok]; ok {
			return runResponse{RequestID: requestID(), Reservation: s.instances[id].Reservation, Owner: owner, Instances: []instanceXML{s.instances[id].xml()}}, nil
		}
	}
	image, ok := s.images[ami]
	if !ok {
		return nil, &apiError{http.StatusBadRequest, "InvalidAMIID.NotFound", fmt.Sprintf("The image id '[%s]' does not exist", ami)}
	}
	devs, aerr := s.mapping(form, ami)
	if aerr != nil {
		return nil, aerr
	}
	subnet := form.Get("SubnetId")
	if subnet == "" {
		subnet = "subnet-0a000000000000001" // the default VPC's first
	}
	zone, ok := s.subnets[subnet]
	if !ok {
		return nil, &apiError{http.StatusBadRequest, "InvalidSubnetID.NotFound", fmt.Sprintf("The subnet ID '%s' does not exist", subnet)}
	}
	market := "on-demand"
	if spot {
		market = "spot"
	}
	if s.noCap[market] || s.noCap[market+" "+typ] || s.noCap[market+" "+typ+" "+zone] {
		if spot {
			return nil, &apiError{http.StatusInternalServerError, "InsufficientInstanceCapacity", fmt.Sprintf("There is no Spot capacity available that matches your request. (%s in %s)", typ, zone)}
		}
		return nil, &apiError{http.StatusInternalServerError, "InsufficientInstanceCapacity", fmt.Sprintf("We currently do not have sufficient %s capacity in the Availability Zone you requested (%s).", typ, zone)}
	}
	if spot {
		if err := s.checkMaxPrice(form.Get("InstanceMarketOptions.SpotOptions.MaxPrice"), typ); err != nil {
			return nil, err
		}
	}
	// With less capacity than MaxCount, EC2 launches as many as it can,
	// and none when that is under MinCount (RunInstances: "Amazon EC2
	// launches the largest possible number of instances above MinCount").
	if left, limited := s.capacity[market+" "+typ]; limited {
		if left < minCount {
			return nil, &apiError{http.StatusInternalServerError, "InsufficientInstanceCapacity", fmt.Sprintf("We currently do not have sufficient %s capacity in the Availability Zone you requested (%s).", typ, zone)}
		}
		maxCount = min(maxCount, left)
		s.capacity[market+" "+typ] = left - maxCount
	}
	if s.closing {
		return nil, &apiError{http.StatusServiceUnavailable, "Unavailable", "The service is unavailable."}
	}
	if err := s.takeResources("RunInstances", maxCount); err != nil {
		return nil, err
	}
	res := "r-" + randHex(9)[:17]
	var out []instanceXML
	for range maxCount {
		in := &Instance{
			ID: "i-" + randHex(9)[:17], Type: typ, Image: ami, Subnet: subnet, Zone: zone, Reservation: res,
			State: "pending", Launched: time.Now().UTC().Truncate(time.Second), Created: time.Now(), Tags: maps.Clone(instTags),
			Spot: spot, UserData: ud, Shutdown: shutdown, HTTPTokens: form.Get("MetadataOptions.HttpTokens"),
			Profile: form.Get("IamInstanceProfile.Name") + form.Get("IamInstanceProfile.Arn"),
		}
		if spot {
			in.SpotRequest, in.MaxPrice = "sir-"+randHex(4), form.Get("InstanceMarketOptions.SpotOptions.MaxPrice")
			in.SpotStatus, in.SpotStatusTime = "fulfilled", in.Launched
			in.SpotTags = spotTags
		}
		n := len(s.order) + 10
		in.hostname = fmt.Sprintf("ip-10-0-%d-%d", n/250, n%250)
		s.instances[in.ID] = in
		s.order = append(s.order, in.ID)
		s.attachVolumes(in, devs, volTags)
		if tok := form.Get("ClientToken"); tok != "" {
			s.tokens[tok] = in.ID
		}
		out = append(out, in.xml())
		s.wg.Add(1)
		go s.boot(in, image)
	}
	return runResponse{RequestID: requestID(), Reservation: res, Owner: owner, Instances: out}, nil
}

const owner = "123456789012"

// describeFilters are the filter names the stand-in knows.
var describeFilters = regexp.MustCompile(`^(tag:.+|tag-key|instance-state-name|instance-id|instance-lifecycle|instance-type|availability-zone|subnet-id)$`)

func (s *Server) describeInstances(form url.Values) (any, *apiError) {
	d, aerr := describeParams(form, "InstanceId", "instancesSet", describeFilters, 5, 1000)
	if aerr != nil {
		return nil, aerr
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range d.ids {
		if _, ok := s.instances[id]; !ok {
			return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.NotFound", fmt.Sprintf("The instance ID '%s' does not exist", id)}
		}
	}
	var match []*Instance
	for _, id := range s.order {
		in := s.instances[id]
		if (len(d.ids) == 0 || slices.Contains(d.ids, id)) && matchFilters(d.filters, in.filterValues) {
			match = append(match, in)
		}
	}
	resp := describeResponse{RequestID: requestID()}
	from, to, next := d.page(len(match))
	resp.NextToken = next
	byRes := map[string]int{}
	for _, in := range match[from:to] {
		i, ok := byRes[in.Reservation]
		if !ok {
			i = len(resp.Reservations)
			byRes[in.Reservation] = i
			resp.Reservations = append(resp.Reservations, reservationXML{ID: in.Reservation, Owner: owner})
		}
		resp.Reservations[i].Instances = append(resp.Reservations[i].Instances, in.xml())
	}
	return resp, nil
}

// filterValues is what the instance says of a filter name.
func (in *Instance) filterValues(name string) []string {
	switch {
	case strings.HasPrefix(name, "tag:"):
		if v, ok := in.Tags[name[4:]]; ok {
			return []string{v}
		}
	case name == "tag-key":
		return slices.Collect(maps.Keys(in.Tags))
	case name == "instance-state-name":
		return []string{in.State}
	case name == "instance-id":
		return []string{in.ID}
	case name == "instance-type":
		return []string{in.Type}
	case name == "availability-zone":
		return []string{in.Zone}
	case name == "subnet-id":
		return []string{in.Subnet}
	case name == "instance-lifecycle" && in.Spot:
		return []string{"spot"}
	}
	return nil
}

// wildcard matches EC2's filter values, where * and ? are wildcards.
func wildcard(pattern, s string) bool {
	if !strings.ContainsAny(pattern, "*?") {
		return pattern == s
	}
	re := "^" + strings.NewReplacer(`\*`, ".*", `\?`, ".").Replace(regexp.QuoteMeta(pattern)) + "$"
	ok, _ := regexp.MatchString(re, s)
	return ok
}

var instanceID = regexp.MustCompile(`^i-[0-9a-f]{8,17}$`)

func (s *Server) terminateInstances(form url.Values) (any, *apiError) {
	ids := list(form, "InstanceId")
	if len(ids) == 0 {
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter InstanceId"}
	}
	s.mu.Lock()
	var todo []*Instance
	resp := terminateResponse{RequestID: requestID()}
	for _, id := range ids {
		if !instanceID.MatchString(id) {
			s.mu.Unlock()
			return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.Malformed", fmt.Sprintf("Invalid id: \"%s\"", id)}
		}
		if _, ok := s.instances[id]; !ok {
			s.mu.Unlock()
			return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.NotFound", fmt.Sprintf("The instance ID '%s' does not exist", id)}
		}
	}
	if err := s.takeResources("TerminateInstances", len(ids)); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	for _, id := range ids {
		in := s.instances[id]
		prev := in.State
		if in.State != "terminated" {
			in.shutDown()
			in.ReasonCode, in.ReasonMessage = "Client.UserInitiatedShutdown", "Client.UserInitiatedShutdown: User initiated shutdown"
			todo = append(todo, in)
		}
		resp.Instances = append(resp.Instances, stateChangeXML{ID: id, Current: stateXML{stateCodes[in.State], in.State}, Previous: stateXML{stateCodes[prev], prev}})
	}
	s.mu.Unlock()
	for _, in := range todo {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.stopInstance(in, in.ReasonCode, in.ReasonMessage)
		}()
	}
	return resp, nil
}

func (s *Server) createTags(form url.Values) (any, *apiError) {
	ids := list(form, "ResourceId")
	if len(ids) == 0 {
		return nil, &apiError{http.StatusBadRequest, "MissingParameter", "The request must contain the parameter ResourceId"}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		in, ok := s.instances[id]
		if !ok {
			return nil, &apiError{http.StatusBadRequest, "InvalidID", fmt.Sprintf("The ID '%s' is not valid", id)}
		}
		for j := 1; ; j++ {
			k, ok := form["Tag."+strconv.Itoa(j)+".Key"]
			if !ok {
				break
			}
			in.Tags[k[0]] = form.Get("Tag." + strconv.Itoa(j) + ".Value")
		}
	}
	return simpleResponse{XMLName: xml.Name{Local: "CreateTagsResponse"}, RequestID: requestID(), Return: true}, nil
}

var spotFilters = regexp.MustCompile(`^(tag:.+|instance-id|state|status-code|spot-instance-request-id)$`)

func (s *Server) describeSpotRequests(form url.Values) (any, *apiError) {
	fs := filters(form)
	for _, f := range fs {
		if !spotFilters.MatchString(f.name) {
			return nil, badParam("The filter '%s' is invalid", f.name)
		}
	}
	want := list(form, "SpotInstanceRequestId")
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := spotResponse{RequestID: requestID()}
	for _, id := range s.order {
		in := s.instances[id]
		if !in.Spot || (len(want) > 0 && !slices.Contains(want, in.SpotRequest)) {
			continue
		}
		state := "active"
		if in.State == "terminated" {
			state = "closed"
		}
		ok := matchFilters(fs, func(name string) []string {
			switch {
			case strings.HasPrefix(name, "tag:"):
				return []string{in.SpotTags[name[4:]]}
			case name == "instance-id":
				return []string{in.ID}
			case name == "state":
				return []string{state}
			case name == "status-code":
				return []string{in.SpotStatus}
			case name == "spot-instance-request-id":
				return []string{in.SpotRequest}
			}
			return nil
		})
		if ok {
			resp.Requests = append(resp.Requests, spotXML{
				ID: in.SpotRequest, State: state, InstanceID: in.ID, Type: "one-time", SpotPrice: in.MaxPrice,
				Status: spotStatusXML{Code: in.SpotStatus, UpdateTime: in.SpotStatusTime.Format(time.RFC3339), Message: spotMessages[in.SpotStatus]},
			})
		}
	}
	return resp, nil
}

var spotMessages = map[string]string{
	"fulfilled":                       "Your spot request is fulfilled.",
	"marked-for-termination":          "Your Spot Instance is marked for termination because of a capacity constraint.",
	"instance-terminated-no-capacity": "Your Spot Instance was terminated because there is no spare capacity to serve it.",
	"instance-terminated-by-user":     "Your Spot Instance was terminated by the user.",
}

// checkMaxPrice refuses a Spot request whose maximum price is not a
// positive price (InvalidParameterValue) or is under the type's Spot
// price (SpotMaxPriceTooLow), as RunInstances does; without one the
// on-demand price is the maximum, which the stand-in always meets
// (docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html;
// .../UserGuide/using-spot-instances-request.html, "maximum price").
// Called with s.mu held.
func (s *Server) checkMaxPrice(maxPrice, typ string) *apiError {
	if maxPrice == "" {
		return nil
	}
	p, err := strconv.ParseFloat(maxPrice, 64)
	if err != nil || p <= 0 || math.IsNaN(p) || math.IsInf(p, 0) {
		return &apiError{http.StatusBadRequest, "InvalidParameterValue", fmt.Sprintf("Invalid value '%s' for SpotOptions.MaxPrice. The value must be a positive number.", maxPrice)}
	}
	price, ok := s.spotPrice[typ]
	if !ok {
		price = DefaultSpotPrice
	}
	if p < price {
		return &apiError{http.StatusBadRequest, "SpotMaxPriceTooLow", fmt.Sprintf("Your Spot request price of %s is lower than the minimum required Spot request fulfillment price of %.4f.", maxPrice, price)}
	}
	return nil
}

type attributeResponse struct {
	XMLName   xml.Name `xml:"DescribeInstanceAttributeResponse"`
	RequestID string   `xml:"requestId"`
	ID        string   `xml:"instanceId"`
	UserData  *struct {
		Value string `xml:"value"`
	} `xml:"userData"`
}

// describeAttribute answers DescribeInstanceAttribute for userData, what
// an account reader with ec2:DescribeInstanceAttribute reads of an
// instance's boot data for its whole life (base64, as EC2 gives it).
func (s *Server) describeAttribute(form url.Values) (any, *apiError) {
	id, attr := form.Get("InstanceId"), form.Get("Attribute")
	if attr != "userData" {
		return nil, badParam("Value (%s) for parameter attribute is invalid. Unknown attribute.", attr)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	in, ok := s.instances[id]
	if !ok {
		return nil, &apiError{http.StatusBadRequest, "InvalidInstanceID.NotFound", fmt.Sprintf("The instance ID '%s' does not exist", id)}
	}
	out := attributeResponse{RequestID: requestID(), ID: id}
	out.UserData = &struct {
		Value string `xml:"value"`
	}{base64.StdEncoding.EncodeToString(in.UserData)}
	return out, nil
}
