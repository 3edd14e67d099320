// Test machinery: the fault transport's freeze points. With freeze_send=N
// (freeze_recv=N) a rank stops itself (SIGSTOP) as it posts its N-th send
// (receive), as a hung process would, for a failure drill to kill it from
// outside. They are off in every process until armed here, so that no
// transport name can stop a user's process: there, asking for one is
// Errc::invalid_argument. The tests that freeze a rank arm them, and so does
// the command in the one worker its failure drills freeze (demo --kill, the
// export's test kill). Private to the build, like the rest of src/.
#pragma once

namespace weightsync::transport::fault {

// From now on, this process's fault transports honour freeze_send and
// freeze_recv. There is no disarming: a drill arms its victim for good.
void arm_freeze_points();
bool freeze_points_armed();

}  // namespace weightsync::transport::fault
