# ctest time bounds for the multi-process test_dist tests (CMakeLists.txt adds this file
# after the discovered tests); ctest ignores names it does not know.
set_tests_properties("Collectives.TwoProcessesFileStore" "Collectives.ThreeProcessesFileStore"
  "Collectives.TwoProcessesTcpStoreOnRankZero" "Collectives.ThreeProcessesTorchrunAgentStore"
  "Collectives.DeadPeerFailsTheNextCollectiveNamingIt" "Collectives.DeadPeerOfThree"
  "Collectives.StuckPeerTimesOut" "Collectives.RendezvousTimesOutNamingTheStore" PROPERTIES TIMEOUT 120)
set_tests_properties("DataParallelTraining.TwoRanksMatchOneProcessWithDoubleBatch"
  "DataParallelTraining.ADeadRankStopsTheOtherNamingTheCollective"
  "DataParallelTraining.ThreeRanksMatchOneProcessWithTripleBatch"
  "DataParallelTraining.GradientAccumulationMatchesOneProcess"
  "DataParallelTraining.UnsupportedSettingIsRefusedOnEveryRank"
  "DataParallelTraining.MaxTrainMinutesSizesEveryRankAlike" PROPERTIES TIMEOUT 300)
set_tests_properties("Launch.TwoRanksTrainOneRun" "Launch.AFailingRankFailsTheLaunchNamingIt"
  "Launch.AKilledRankStopsTheRunAndLeavesNoProcess" "Launch.TwoRanksEncodeDisjointSharesOfTheDiskCache"
  "Launch.AnIgnoredHangupStaysIgnored"
  "Torchrun.ARestartedGroupResumesFromItsLastCheckpoint"
  PROPERTIES TIMEOUT 180)
set_tests_properties("ZeroCollectives.TwoProcesses" "ZeroCollectives.ThreeProcesses" PROPERTIES TIMEOUT 120)
set_tests_properties("ZeroTwoRanks.AdamW" "ZeroTwoRanks.AdamW8bit" "ZeroTwoRanks.Adafactor"
  "ZeroEma.ShardedWithItsTensorsSavedInTheShardsAndSwappedInForTheFinalFile"
  "ZeroStage3.TwoRanksAdafactorBf16StochasticRounding"
  "ZeroStage3.ThreeRanksWithGradientAccumulation" "ZeroStage3.FusedBackward"
  "ZeroStage3.Bf16WithGradientAccumulation" "ZeroCheckpoint.Stage3ResumesAtTwoRanksAndOneProcess"
  "ZeroTwoRanks.Bf16StochasticRounding"
  "ZeroTraining.ThreeRanksMatchOneProcessWithTripleBatch"
  "ZeroCheckpoint.ShardedResumesAtOneTwoAndThreeRanksAndConsolidates"
  "ZeroCheckpoint.ARankKilledWhileWritingItsShardLeavesAResumableRun"
  "ZeroTraining.ConfigsItCannotRunAreRefusedNamingTheKey" "ZeroFinalFile.Fp32FromTheOwnersMastersAndEmaShadows"
  "ZeroTwoRanks.FusedTwoPassClipsAsTheUnfusedPath"
  PROPERTIES TIMEOUT 480)
