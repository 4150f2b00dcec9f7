// A Curator election client driven line by line from stdin, for crates/lock-zk/tests/curator_election.rs.
//
// Usage: java -cp <classes>:<jars> CuratorElection <connect string>
// Prints "ready" once connected, then answers each command on stdout:
//   campaign PATH ID  -> starts a LeaderSelector on PATH with participant id ID; prints
//                        "elected PATH" when it takes leadership (it then leads until resign)
//   resign PATH       -> ends that leadership (or the wait for it); prints "resigned PATH" once
//                        the selector is closed (its node deleted)
//   leader PATH       -> prints "leader PATH <true|false> <id>" (LeaderSelector.getLeader())
//   quit              -> closes everything and exits
// Anything unexpected prints "error <message>".
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.CountDownLatch;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderSelector;
import org.apache.curator.framework.recipes.leader.LeaderSelectorListenerAdapter;
import org.apache.curator.framework.recipes.leader.Participant;
import org.apache.curator.retry.RetryNTimes;

public final class CuratorElection {
    private static final Object OUT = new Object();

    private static void say(String line) {
        synchronized (OUT) {
            System.out.println(line);
            System.out.flush();
        }
    }

    private static final class Campaign {
        final LeaderSelector selector;
        final String id;
        final CountDownLatch resign = new CountDownLatch(1);
        volatile boolean elected;

        Campaign(CuratorFramework client, String path, String id) {
            this.id = id;
            selector = new LeaderSelector(client, path, new LeaderSelectorListenerAdapter() {
                @Override
                public void takeLeadership(CuratorFramework c) throws Exception {
                    elected = true;
                    say("elected " + path);
                    resign.await();
                }
            });
            selector.setId(id);
        }
    }

    private static boolean isParticipant(LeaderSelector selector, String id) throws Exception {
        for (Participant p : selector.getParticipants()) {
            if (p.getId().equals(id)) {
                return true;
            }
        }
        return false;
    }

    public static void main(String[] args) throws Exception {
        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(args[0])
                .sessionTimeoutMs(10000)
                .connectionTimeoutMs(5000)
                .retryPolicy(new RetryNTimes(3, 100))
                .build();
        client.start();
        client.blockUntilConnected();
        say("ready");
        Map<String, Campaign> campaigns = new HashMap<>();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] w = line.trim().split(" ");
            try {
                if (w[0].equals("campaign") && w.length == 3 && !campaigns.containsKey(w[1])) {
                    Campaign c = new Campaign(client, w[1], w[2]);
                    campaigns.put(w[1], c);
                    c.selector.start();
                } else if (w[0].equals("resign") && w.length == 2 && campaigns.containsKey(w[1])) {
                    Campaign c = campaigns.remove(w[1]);
                    if (c.elected) {
                        // Let the leader give the mutex back itself (close() would interrupt
                        // the release), then close.
                        c.resign.countDown();
                        long until = System.nanoTime() + 10_000_000_000L;
                        while (isParticipant(c.selector, c.id) && System.nanoTime() < until) {
                            Thread.sleep(5);
                        }
                    }
                    c.selector.close();
                    say("resigned " + w[1]);
                } else if (w[0].equals("leader") && w.length == 2) {
                    LeaderSelector observer = new LeaderSelector(client, w[1], new LeaderSelectorListenerAdapter() {
                        @Override
                        public void takeLeadership(CuratorFramework c) {}
                    });
                    Participant p = observer.getLeader();
                    say("leader " + w[1] + " " + p.isLeader() + " " + p.getId());
                } else if (w[0].equals("quit")) {
                    break;
                } else {
                    say("error unexpected command: " + line);
                }
            } catch (Exception e) {
                say("error " + e);
            }
        }
        for (Campaign c : campaigns.values()) {
            c.selector.close();
        }
        client.close();
    }
}
